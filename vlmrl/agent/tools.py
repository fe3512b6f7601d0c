"""Tools: Python functions with a JSON schema, called by the policy in its family's convention, never fatal.

A tool is a plain function `fn(context, **arguments)` and a JSON schema for its arguments (`Tool`). `context` is the
episode's `ToolContext`: the images seen so far (the sample's, then every image a tool returned, in order) and the
pixel budget images are returned at. A tool returns text, an image, or a list of content blocks
(`{"type": "text", "text": ...}`, `{"type": "image", "image": PIL.Image}`).

The policy calls tools the way its family was trained to (Qwen's and Hermes' convention, which SmolVLM, LLaVA and
Gemma 3 fine-tunes share): `<tool_call>{"name": "zoom", "arguments": {"box": [0, 0, 112, 112]}}</tool_call>`.
`run_calls` parses every call in a message and runs it; a call that is not JSON, names no known tool, has arguments
that do not match the schema, raises, or runs past its time limit gives an error text to the policy instead of a
result and is counted as a failure (`ToolResult.ok` False; the trainer logs `tool/failures`). A thread cannot be
stopped, so a tool that hangs is abandoned on its daemon thread after `timeout` seconds, and the episode goes on.

Built-in tools: `zoom` (a region of any image seen so far, returned at the pixel budget: small details become
readable), `crop` (the region at its own pixels) and `calculator` (arithmetic through `simpleeval`, bounded).
"""

from __future__ import annotations

import functools
import json
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vlmrl.errors import ConfigError

TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")  # single tokens in Qwen's vocab
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN_CALL = "<tool_call>"


@dataclass
class ToolContext:
    """What a tool may use: every image of the episode so far, in order, and the pixel budget of returned images."""

    images: list = field(default_factory=list)
    max_pixels: int | None = None  # None: the family resizes every image to one size (zoom then crops)
    columns: dict = field(default_factory=dict)  # the sample's columns (read-only by convention)


@dataclass(frozen=True)
class Tool:
    """A callable the policy may use: `fn(context, **arguments)` -> text | image | content blocks."""

    name: str
    fn: Callable[..., Any]
    parameters: dict  # JSON schema of the arguments ({"type": "object", "properties": ..., "required": [...]})
    description: str = ""
    timeout: float = 10.0

    def schema(self) -> dict:
        """The function description chat templates and system prompts show the model (OpenAI's tool format)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class ToolResult:
    """One call's outcome: the content blocks the policy sees next turn, and whether it was a valid, working call."""

    name: str | None
    content: list[dict]
    ok: bool
    error: str | None = None  # "parse", "unknown_tool", "arguments", "raised", "timeout"
    arguments: dict | None = None  # the arguments of a call that passed its schema


def parse_calls(message: str) -> list[str]:
    """The raw payload of every `<tool_call>...</tool_call>` in `message`, in order; an opened call that never
    closes counts as one (malformed) call."""
    calls = TOOL_CALL.findall(message)
    end = message.rfind("</tool_call>")
    tail = message[end + len("</tool_call>"):] if end >= 0 else message
    if OPEN_CALL in tail and "</tool_call>" not in tail[tail.index(OPEN_CALL):]:
        calls.append(tail[tail.index(OPEN_CALL) + len(OPEN_CALL):])
    return calls


def _failure(name: str | None, kind: str, text: str) -> ToolResult:
    return ToolResult(name, [{"type": "text", "text": f"Error: {text}"}], False, kind)


def _blocks(value: Any) -> list[dict]:
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") in ("text", "image") for b in value):
        return value
    if hasattr(value, "convert") and hasattr(value, "size"):  # a PIL image
        return [{"type": "image", "image": value}]
    if isinstance(value, (int, float)):
        return [{"type": "text", "text": str(value)}]
    raise TypeError(f"returned {type(value).__name__}; a tool returns text, an image or a list of content blocks")


@functools.lru_cache(maxsize=64)
def _validator(schema_json: str):
    """A checked validator per distinct schema (checking a schema costs far more than validating arguments)."""
    import jsonschema

    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def validator(tool: Tool):
    return _validator(json.dumps(tool.parameters, sort_keys=True))


@functools.lru_cache(maxsize=4096)
def _argument_error(schema_json: str, arguments_json: str) -> str | None:
    """None when the arguments match the schema, else "where: message". Remembered per (schema, arguments): a
    group's trajectories often make the same call, and validating took ~0.25 ms a call."""
    import jsonschema

    try:
        _validator(schema_json).validate(json.loads(arguments_json))
    except jsonschema.ValidationError as exc:
        return f"{'/'.join(str(p) for p in exc.absolute_path) or 'arguments'}: {exc.message}"
    return None


class _Worker:
    """A daemon thread that runs the tool calls handed to it, one at a time."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True, name="vlmrl-tool").start()

    def _loop(self) -> None:
        while True:
            target, done = self.jobs.get()
            target()
            done.set()


_idle_workers: list[_Worker] = []
_workers_lock = threading.Lock()


def _run_within(target: Callable[[], None], timeout: float) -> bool:
    """Run `target` on an idle worker thread (a new one if none is idle: starting a thread per call took ~0.2 ms);
    False when it did not finish within `timeout` seconds: its worker is then left with it, never reused."""
    with _workers_lock:
        worker = _idle_workers.pop() if _idle_workers else None
    worker = worker or _Worker()
    done = threading.Event()
    worker.jobs.put((target, done))
    if not done.wait(timeout):
        return False
    with _workers_lock:
        _idle_workers.append(worker)
    return True


def call_tool(payload: str, tools: dict[str, Tool], context: ToolContext) -> ToolResult:
    """Parse one call's JSON, check its arguments against the tool's schema, run it under the tool's time limit."""
    try:
        call = json.loads(payload)
    except json.JSONDecodeError as exc:
        return _failure(None, "parse", f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return _failure(None, "parse", 'a tool call is {"name": ..., "arguments": {...}}')
    name, arguments = call["name"], call.get("arguments", {})
    if name not in tools:
        return _failure(name, "unknown_tool", f"no tool named {name!r}; tools: {', '.join(sorted(tools))}")
    tool = tools[name]
    error = _argument_error(json.dumps(tool.parameters, sort_keys=True), json.dumps(arguments, sort_keys=True))
    if error is not None:
        return _failure(name, "arguments", f"{name}: {error}")
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = _blocks(tool.fn(context, **arguments))
        except Exception as exc:  # the tool's own failure, reported to the policy
            outcome["error"] = f"{type(exc).__name__}: {exc}"

    if not _run_within(target, tool.timeout):
        return _failure(name, "timeout", f"{name} did not finish within {tool.timeout:g} s")
    if "error" in outcome:
        return _failure(name, "raised", f"{name} failed: {outcome['error']}")
    return ToolResult(name, outcome["value"], True, arguments=arguments)


def run_calls(message: str, tools: dict[str, Tool], context: ToolContext) -> list[ToolResult]:
    """Every tool call in `message`, run in order; returned images join `context.images` (later calls see them)."""
    results = []
    for payload in parse_calls(message):
        result = call_tool(payload, tools, context)
        context.images.extend(b["image"] for b in result.content if b["type"] == "image")
        results.append(result)
    return results


# -- built-in tools ------------------------------------------------------------------------------------------------
BOX_SCHEMA = {
    "type": "object",
    "properties": {
        "box": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4,
                "description": "[x1, y1, x2, y2] in the image's pixels"},
        "image": {"type": "integer", "minimum": 0, "description": "which image (0 = the first); default the last"},
    },
    "required": ["box"],
    "additionalProperties": False,
}


def _region(context: ToolContext, box: list[float], image: int | None):
    if not context.images:
        raise ValueError("there is no image to look at")
    index = len(context.images) - 1 if image is None else image
    if index >= len(context.images):
        raise ValueError(f"image {index} does not exist; the episode has {len(context.images)} image(s)")
    im = context.images[index]
    x1, y1, x2, y2 = box
    w, h = im.size
    x1, x2 = max(0.0, min(x1, x2)), min(float(w), max(x1, x2))
    y1, y2 = max(0.0, min(y1, y2)), min(float(h), max(y1, y2))
    if x2 - x1 < 1 or y2 - y1 < 1:
        raise ValueError(f"box {box} holds no pixels of the {w}x{h} image")
    return im.crop((round(x1), round(y1), round(x2), round(y2)))


def zoom(context: ToolContext, box: list[float], image: int | None = None):
    """The region `box` of an image, scaled up (keeping its aspect) to the pixel budget: details too small for the
    whole image's budget become visible."""
    region = _region(context, box, image)
    if context.max_pixels is None:  # the processor enlarges it to its fixed size anyway
        return region
    w, h = region.size
    scale = (context.max_pixels / (w * h)) ** 0.5
    return region.resize((max(1, round(w * scale)), max(1, round(h * scale))))


def crop(context: ToolContext, box: list[float], image: int | None = None):
    """The region `box` of an image at its own pixels."""
    return _region(context, box, image)


def calculator(context: ToolContext, expression: str) -> str:
    """An arithmetic expression's value (+ - * / // % ** and parentheses; powers and string sizes are bounded)."""
    from simpleeval import SimpleEval

    if len(expression) > 200:
        raise ValueError("the expression is over 200 characters")
    evaluator = SimpleEval(functions={}, names={})
    value = evaluator.eval(expression)
    if not isinstance(value, (int, float)):
        raise ValueError(f"{expression!r} is not arithmetic")
    return str(value)


BUILTIN_TOOLS: dict[str, Tool] = {
    "zoom": Tool("zoom", zoom, BOX_SCHEMA, "Zoom in on a region of an image: returns it enlarged."),
    "crop": Tool("crop", crop, BOX_SCHEMA, "Crop a region of an image at its own resolution."),
    "calculator": Tool("calculator", calculator,
                       {"type": "object", "properties": {"expression": {"type": "string"}},
                        "required": ["expression"], "additionalProperties": False},
                       "Evaluate an arithmetic expression."),
}


def resolve_tools(specs: list) -> dict[str, Tool]:
    """Tools from a recipe's `agent.tools`: built-in names, or mappings {name, function: "file.py:func",
    parameters: {JSON schema}, description, timeout} for the user's own."""
    from vlmrl.references import resolve_reference

    tools: dict[str, Tool] = {}
    for i, spec in enumerate(specs):
        if isinstance(spec, str):
            if spec not in BUILTIN_TOOLS:
                raise ConfigError(f"agent.tools[{i}]: unknown tool {spec!r}; built-in tools: "
                                  f"{', '.join(sorted(BUILTIN_TOOLS))}, or {{name, function: 'file.py:func', "
                                  "parameters: {...}}")
            tool = BUILTIN_TOOLS[spec]
        elif isinstance(spec, dict) and {"name", "function"} <= spec.keys():
            unknown = set(spec) - {"name", "function", "parameters", "description", "timeout"}
            if unknown:
                raise ConfigError(f"agent.tools[{i}]: unknown keys {sorted(unknown)}; a tool has name, function, "
                                  "parameters, description, timeout")
            fn = resolve_reference(spec["function"], "tool", {})
            tool = Tool(spec["name"], fn, spec.get("parameters") or {"type": "object"}, spec.get("description", ""),
                        float(spec.get("timeout", 10.0)))
        else:
            raise ConfigError(f"agent.tools[{i}]: {spec!r}; give a built-in name or {{name, function, parameters}}")
        if tool.name in tools:
            raise ConfigError(f"agent.tools[{i}]: a second tool named {tool.name!r}")
        try:
            validator(tool)
        except Exception as exc:  # jsonschema.SchemaError: the recipe's schema itself is wrong
            raise ConfigError(f"agent.tools[{i}] ({tool.name}): parameters is not a valid JSON schema: "
                              f"{getattr(exc, 'message', exc)}") from exc
        tools[tool.name] = tool
    return tools


def tools_system_prompt(tools: dict[str, Tool]) -> str:
    """The tools described to the model the way Qwen's and Hermes' templates do (JSON schemas in <tools>)."""
    schemas = "\n".join(json.dumps(t.schema()) for t in tools.values())
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
            f"function signatures within <tools></tools> XML tags:\n<tools>\n{schemas}\n</tools>\n\nFor each function "
            "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
