"""Every `vlmrl` command the README and docs/*.md show in a fenced block still works, so a renamed flag, key or
subcommand fails here, not in a reader's shell.

The rule, for each command in the order the pages give them (`vlmrl ...`, `python -m vlmrl ...` and
`torchrun ... -m vlmrl ...`; a line continued with `\\` is one command; RECIPE stands for recipes/grpo.yaml):

1. **parsed**: every command parses with the real `vlmrl` parser (subcommand, flags, choices, value types).
2. **validated**: every other training (`train`, `reclip train`) runs with `--show-config` appended, the CLI's dry
   run: the recipe loads and every dotted override names a real key with a valid value; nothing is trained. A
   `train`'s built-in task specs (data.train, data.sft, data.eval) also build one sample each, since their options
   (`data.sft.demo_on_target`) are checked when the data is built, not when the recipe loads.
3. **ran**: commands that finish in seconds on a CPU and read nothing the reader brings (no network, GPU, hub model,
   long-running server, photos or data of their own) run for real in a scratch folder: the quickstart (`vlmrl
   train`, first, with the smoke overrides of benchmarks/smoke.py) and then the `eval`, `report`, `export` and
   `data` commands whose inputs exist there, trimmed to a few samples (eval: `data.eval.n=8`, `--samples 2`,
   `--n 8`). Each must exit 0. A `runs/quickstart/checkpoint-N` the two-step stand-in lacks (the docs name the real
   run's checkpoint-1500) stands for its newest checkpoint.

Inline spans (`vlmrl SUB ...` in single backticks, often synopses such as `[--kind flat|ivf|hnsw]`) are checked
lighter: their subcommand exists and every `--flag` they name is one of its options.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from vlmrl.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from smoke import SMOKE  # noqa: E402

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDERS = {"RECIPE": "recipes/grpo.yaml"}
QUICKSTART = ["train"]  # `vlmrl train`: trained for real with the smoke overrides, once, before the others
STAND_IN = [*SMOKE, "trainer.steps=2", "trainer.threads=1"]
INPUTS = {("eval",): "checkpoint", ("export",): "checkpoint", ("report",): "runs", ("data", "check"): "path"}
RUN_ALWAYS = {("data", "tasks"), ("data", "export")}
EVAL_TRIM = ["data.eval.n=8"]


@dataclass
class DocCommand:
    where: str  # page:line
    argv: list[str]  # after `vlmrl`

    def __str__(self) -> str:
        return f"{self.where}: vlmrl {shlex.join(self.argv)}"


def vlmrl_argv(tokens: list[str]) -> list[str] | None:
    """The arguments after `vlmrl` in one shell command (None when it does not run vlmrl): `vlmrl ...`,
    `python -m vlmrl ...`, `torchrun ... -m vlmrl ...`, after any NAME=value prefixes."""
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
        tokens = tokens[1:]
    if tokens[:1] == ["vlmrl"]:
        return tokens[1:]
    for i in range(len(tokens) - 1):
        if tokens[i] == "-m" and tokens[i + 1] == "vlmrl":
            return tokens[i + 2:]
    return None


def fenced_commands(page: Path) -> list[DocCommand]:
    out, lines = [], page.read_text().splitlines()
    fence, i = False, 0
    while i < len(lines):
        line, first = lines[i], i + 1
        if line.lstrip().startswith("```"):
            fence = not fence
        elif fence:
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            if not re.search(r"(^|\s)vlmrl(\s|$)", line):  # not a command line of vlmrl's (code, output, YAML)
                i += 1
                continue
            tokens = shlex.split(line.strip().removeprefix("$ "), comments=True)
            command: list[str] = []
            for token in [*tokens, "&&"]:  # each command of `a && b`, `a; b`, `a | b`
                if token in ("&&", "||", ";", "|"):
                    argv = vlmrl_argv(command) if command else None
                    if argv is not None:
                        out.append(DocCommand(f"{page.relative_to(ROOT)}:{first}",
                                              [PLACEHOLDERS.get(a, a) for a in argv]))
                    command = []
                else:
                    command.append(token)
        i += 1
    return out


def inline_commands(page: Path) -> list[DocCommand]:
    out = []
    for n, line in enumerate(page.read_text().splitlines(), 1):
        for span in re.findall(r"`(?:python -m )?vlmrl ([^`]+)`", line):
            out.append(DocCommand(f"{page.relative_to(ROOT)}:{n}", span.split()))
    return out


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def command_path(argv: list[str]) -> tuple[tuple[str, ...], argparse.ArgumentParser]:
    """(('data', 'check'), its parser): the subcommands `argv` names, as far as the parser has them."""
    parser, path = build_parser(), []
    for word in argv:
        choices = subparsers(parser)
        if word not in choices:
            break
        parser, path = choices[word], [*path, word]
    return tuple(path), parser


def parse(command: DocCommand, capsys) -> argparse.Namespace:
    try:
        return build_parser().parse_args(command.argv)
    except SystemExit:
        pytest.fail(f"{command}\ndoes not parse: {capsys.readouterr().err.strip()}")


def run(command: DocCommand, argv: list[str], capsys) -> None:
    capsys.readouterr()
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, f"{command}\nran as vlmrl {shlex.join(argv)} and exited {code}:\n{captured.err[-2000:]}"


def inputs_exist(path: tuple[str, ...], args: argparse.Namespace) -> bool:
    value = getattr(args, INPUTS[path])
    return all(Path(v).exists() for v in (value if isinstance(value, list) else [value]))


def stand_in(word: str) -> str:
    """`word`, or the stand-in run's newest checkpoint for a runs/quickstart/checkpoint-N that it lacks."""
    if re.fullmatch(r"runs/quickstart/checkpoint-\d+", word) and not Path(word).exists():
        return str(max(Path("runs/quickstart").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])))
    return word


def build_task_specs(command: DocCommand, words: list[str]) -> None:
    """One sample of each built-in task spec a training's data names (`words`: its recipe and overrides, as
    `vlmrl train` reads them): an unknown task option fails here."""
    from vlmrl.config import QUICKSTART, load_config
    from vlmrl.data import build_dataset
    from vlmrl.errors import VlmrlError

    recipe, overrides = (words[0], words[1:]) if words and "=" not in words[0] else (None, words)
    cfg = load_config(recipe or QUICKSTART, overrides)
    for key, split in (("train", "train"), ("sft", "train"), ("eval", "test")):
        spec = getattr(cfg.data, key)
        for one in spec if isinstance(spec, list) else [spec]:
            if isinstance(one, dict) and "task" in one:
                try:
                    build_dataset({**one, "n": 1}, split, cfg.data.seed)
                except VlmrlError as e:
                    pytest.fail(f"{command}\ndata.{key}: {e}")


def check(command: DocCommand, capsys) -> str:
    """Check one fenced command by the module's rule: 'ran', 'validated' or 'parsed'."""
    parse(command, capsys)
    argv = [stand_in(word) for word in command.argv]
    args = build_parser().parse_args(argv)
    path, _ = command_path(argv)
    if path in (("train",), ("reclip", "train")):
        if "--resume" in argv and not Path(args.resume).exists():  # a run the scratch folder lacks: its recipe alone
            at = argv.index("--resume")
            argv = argv[:at] + argv[at + 2:]
        run(command, [*argv, "--show-config"], capsys)
        if path == ("train",):
            build_task_specs(command, build_parser().parse_args(argv).args)
        return "validated"
    if path in RUN_ALWAYS or path in INPUTS and inputs_exist(path, args):
        if path == ("eval",):
            if getattr(args, "benchmark", None):
                return "parsed"  # the benchmark's hub data is not here
            at = argv.index(args.checkpoint) + 1
            argv = [*argv[:at], *EVAL_TRIM, *argv[at:], "--n", "8"] + ([] if args.k else ["--samples", "2"])
        run(command, argv, capsys)
        return "ran"
    return "parsed"


def test_every_fenced_vlmrl_command_in_the_docs_parses_validates_or_runs(tmp_path, monkeypatch, capsys):
    commands = [c for page in PAGES for c in fenced_commands(page)]
    quickstart = [c for c in commands if c.argv == QUICKSTART]
    assert quickstart, "README.md no longer shows `vlmrl train`, the quickstart"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    parse(quickstart[0], capsys)
    run(quickstart[0], [*QUICKSTART, *STAND_IN], capsys)  # runs/quickstart, which the commands below read
    done: dict[str, list[str]] = {"ran": [str(quickstart[0])], "validated": [], "parsed": []}
    for command in commands:
        if command is not quickstart[0]:
            done[check(command, capsys)].append(str(command))
    with capsys.disabled():
        print(f"\n{len(commands)} fenced vlmrl commands in {len(PAGES)} pages: "
              + ", ".join(f"{len(v)} {k}" for k, v in done.items()))
        for kind in done:
            print(f"  {kind}:\n    " + "\n    ".join(done[kind]))
    assert len(commands) >= 50 and len(done["ran"]) >= 8 and len(done["validated"]) >= 15, \
        {k: len(v) for k, v in done.items()}


def test_every_flag_an_inline_vlmrl_span_names_exists():
    problems, count = [], 0
    for command in (c for page in PAGES for c in inline_commands(page)):
        count += 1
        path, parser = command_path(command.argv)
        if not path:
            problems.append(f"{command}: no such subcommand {command.argv[0]!r}")
            continue
        options = {s for action in parser._actions for s in action.option_strings}
        for word in command.argv:
            flag = word.strip("[]").split("=")[0]
            if flag.startswith("--") and flag not in options:
                problems.append(f"{command}: `vlmrl {' '.join(path)}` has no option {flag}")
    assert count >= 20, f"found only {count} inline vlmrl spans"
    assert not problems, "\n".join(problems)


# one reward of a recipe's list, on one line, one nesting deep
REWARD_ENTRY = re.compile(r"\{name: [\w\"'.]+(?:[^{}\n]|\{[^{}\n]*\})*\}")


def test_every_reward_entry_the_docs_show_loads_as_a_recipes_reward():
    """`{name: ..., ...}` as the pages write a reward (inline or in a YAML block) is a valid `rewards` entry: a key
    the reward takes goes under kwargs, and one at the top level is refused by the recipe loader."""
    from vlmrl.config import load_config
    from vlmrl.errors import ConfigError

    problems, count = [], 0
    for page in PAGES:
        for entry in REWARD_ENTRY.findall(page.read_text()):
            if entry in ("{name: spec}",):  # a placeholder, not a reward
                continue
            count += 1
            try:
                load_config(None, [f"rewards=[{entry}]"])
            except ConfigError as exc:
                problems.append(f"{page.name}: {entry}: {exc}")
    assert count >= 15, f"found only {count} reward entries"
    assert not problems, "\n".join(problems)
