"""The machinery behind every vlmrl recipe: typed sections whose value constraints are declared with each field,
YAML files, dotted command-line overrides, cross-field rules, and errors that name the key and what is allowed.

A section is a dataclass decorated with `@section`: pydantic validates each field strictly (no string-to-number
guessing, no `1.0` for an integer, no NaN or infinity) against its type and its `Annotated` constraints, and
`allowed(tp)` turns the same declaration into the text that error messages and docs/recipes.md show. Cross-field
constraints are `Rule`s: a sentence for the docs and a check that returns the error message.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import annotated_types as at
import pydantic
import yaml
from pydantic import ConfigDict

from vlmrl.errors import ConfigError
from vlmrl.references import is_file_reference

# the constraint vocabulary of the recipes (annotated_types markers, which pydantic enforces)
PositiveInt = Annotated[int, at.Ge(1)]
Count = Annotated[int, at.Ge(0)]  # 0 allowed: "off", "none" or "all", as the field's comment says
Positive = Annotated[float, at.Gt(0)]
NonNegative = Annotated[float, at.Ge(0)]
Probability = Annotated[float, at.Gt(0), at.Le(1)]  # (0, 1]
Fraction = Annotated[float, at.Ge(0), at.Lt(1)]  # [0, 1)
UnitInterval = Annotated[float, at.Ge(0), at.Le(1)]  # [0, 1]
Name = Annotated[str, at.MinLen(1)]
# a user's function: "path/to/file.py:function" or "package.module:function" (resolved by vlmrl.references)
FunctionRef = Annotated[str, at.Predicate(is_file_reference)]

section = pydantic.dataclasses.dataclass(config=ConfigDict(strict=True, extra="forbid", allow_inf_nan=False))


@dataclass(frozen=True)
class Rule:
    """A constraint between fields. `text` is the rule as docs/recipes.md lists it; `check(cfg)` returns the error
    message (naming the keys, their values and the fix) or None."""

    keys: tuple[str, ...]
    text: str
    check: Callable[[Any], str | None]


# ---------------------------------------------------------------------------------------------------------------
# what a type allows, in words


def _bounds(metadata: Sequence) -> str:
    parts = []
    for m in metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                parts.append(f"{op} {getattr(m, attr)}")
    return " and ".join(parts)


def allowed(tp) -> str:
    """What a field of type `tp` accepts, e.g. "an integer >= 1", "a number in (0, 1]", "null or a number > 1"."""
    if typing.get_origin(tp) is Annotated:
        base, *metadata = typing.get_args(tp)
        interval = {type(m).__name__: m for m in metadata}
        if base is float and {"Gt", "Le"} <= interval.keys():
            return f"a number in ({interval['Gt'].gt}, {interval['Le'].le}]"
        if base is float and {"Ge", "Lt"} <= interval.keys():
            return f"a number in [{interval['Ge'].ge}, {interval['Lt'].lt})"
        if base is float and {"Ge", "Le"} <= interval.keys():
            return f"a number in [{interval['Ge'].ge}, {interval['Le'].le}]"
        if base is str and any(isinstance(m, at.MinLen) and m.min_length == 1 for m in metadata):
            return "a non-empty string"
        if base is str and any(isinstance(m, at.Predicate) and m.func is is_file_reference for m in metadata):
            return "'path/to/file.py:function' or 'package.module:function'"
        bounds = _bounds(metadata)
        return f"{allowed(base)} {bounds}" if bounds else allowed(base)
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        text = " or ".join(allowed(a) for a in args)
        return f"null or {text}" if type(None) in typing.get_args(tp) else text
    if origin is list:
        (item,) = typing.get_args(tp)
        return f"a list of {_plural(allowed(item))}"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping",
             Any: "any value"}
    if tp in names:
        return names[tp]
    if dataclasses.is_dataclass(tp):
        return f"a mapping of {', '.join(f.name for f in dataclasses.fields(tp))}"
    return getattr(tp, "__name__", str(tp))


def _plural(text: str) -> str:
    for single, plural in (("an integer", "integers"), ("a number", "numbers"), ("a string", "strings"),
                           ("a mapping", "mappings")):
        if text.startswith(single):
            return plural + text[len(single):]
    return text


# ---------------------------------------------------------------------------------------------------------------
# building a typed config from plain data


def _hints(cls) -> dict:
    return typing.get_type_hints(cls, include_extras=True)


def _strip(tp):
    """The type without its Annotated constraints or Optional wrapper (for recursion into sections)."""
    if typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (Union, types.UnionType) and len(args) == 1:
        return args[0]
    return tp


def _field_type(cls, loc: tuple) -> tuple[Any, str]:
    """The declared type at `loc` (field names and list indices) under `cls`, and the dotted key it spells."""
    tp, key = cls, ""
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
            inner = _strip(tp)
            tp = typing.get_args(inner)[0] if typing.get_origin(inner) is list else Any
            continue
        inner = _strip(tp)
        if not dataclasses.is_dataclass(inner) and tp is not Any:
            continue  # pydantic's tag for the branch of a union that failed (e.g. "literal['grpo', ...]")
        key += ("." if key else "") + str(part)
        tp = _hints(inner).get(part, Any) if dataclasses.is_dataclass(inner) else Any
    return tp, key


def _error(cls, exc: pydantic.ValidationError, prefix: str) -> ConfigError:
    err = exc.errors(include_url=False)[0]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # raised by a section's own __post_init__
        return cause
    loc = tuple(p for p in err["loc"] if p != "__post_init__")
    tp, key = _field_type(cls, loc)
    if err["type"] == "unexpected_keyword_argument":
        names = ", ".join(f.name for f in dataclasses.fields(cls))
        return ConfigError(f"unknown key '{prefix}{key}'; allowed keys under {prefix.rstrip('.') or 'the top'}: {names}")
    if not loc:
        return ConfigError(f"{prefix.rstrip('.') or 'config'}: {err['msg']}")
    return ConfigError(f"{prefix}{key}: {err['input']!r} is not allowed; expected {allowed(tp)}")


def from_dict(cls, data: dict, prefix: str = ""):
    """Build section `cls` from `data`; an unknown key or a value its declaration does not allow raises ConfigError
    naming the key and what is allowed."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected {allowed(cls)}, got {data!r}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ConfigError(f"unknown key '{prefix}{unknown[0]}'; allowed keys under {prefix.rstrip('.') or 'the top'}:"
                          f" {', '.join(names)}")
    kwargs = {}
    for key, value in data.items():
        tp = _strip(hints[key])
        if dataclasses.is_dataclass(tp) and not isinstance(value, tp):
            value = from_dict(tp, value, prefix + key + ".")
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]) \
                and isinstance(value, list):
            item = typing.get_args(tp)[0]
            value = [v if isinstance(v, item) else from_dict(item, v, f"{prefix}{key}[{i}].")
                     for i, v in enumerate(value)]
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except pydantic.ValidationError as exc:
        raise _error(cls, exc, prefix) from None


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def check_rules(cfg, rules: Sequence[Rule]) -> None:
    for rule in rules:
        message = rule.check(cfg)
        if message:
            raise ConfigError(message)


def validate(cfg, rules: Sequence[Rule] = ()):
    """Check a config built or changed in code as `load` checks a recipe: every field, then every rule."""
    cfg = from_dict(type(cfg), to_dict(cfg))
    check_rules(cfg, rules)
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# recipes and overrides


def parse_override(text: str) -> tuple[list[str], Any]:
    """`trainer.lr=1e-5` -> (["trainer", "lr"], 1e-5); the value is read as YAML (numbers, lists, true/false)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value (e.g. trainer.lr=1e-5)")
    key, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else ""
    if isinstance(value, str) and _looks_numeric(value) and value.strip().lower() not in ("nan", "inf", "-inf",
                                                                                           "+inf", "infinity"):
        value = float(value)  # YAML 1.1 reads "1e-5" as a string
    return key.strip().split("."), value


def _looks_numeric(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _section_type(dotted: str, cls):
    """The section class at the dotted key (a number indexes a list of sections: `rewards.1` is a reward entry), or
    None where the key is not a typed section but a free-form value."""
    tp = cls
    for part in dotted.split(".") if dotted else []:
        if dataclasses.is_dataclass(tp):
            hints = _hints(tp)
            if part not in hints:
                return None
            tp = _strip(hints[part])
        elif typing.get_origin(tp) is list and part.isdigit():
            tp = _strip(typing.get_args(tp)[0])
        else:
            return None
    return tp if dataclasses.is_dataclass(tp) else None


def _is_section(dotted: str, cls) -> bool:
    """True where the key is a typed config section (so its keys are validated), not a free-form mapping."""
    return _section_type(dotted, cls) is not None


def _set_dotted(data: dict, path: list[str], value, cls) -> None:
    """Apply one command-line override. Keys of typed sections are checked here; inside a free-form value (a data
    spec, reward kwargs) the key is set as given and checked by whatever reads it, still before any model is built.
    A number indexes a list (`rewards.1.kwargs.base_url=...`); it must name an item that exists."""
    node = data
    for i, part in enumerate(path):
        dotted, here = ".".join(path[:i]), ".".join(path[:i + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                items = f"its items are {dotted}.0 to {dotted}.{len(node) - 1}" if node else "it is empty"
                raise ConfigError(f"override {'.'.join(path)}: {here!r} is out of range: {dotted} is a list of "
                                  f"{len(node)} item(s), {items} (a recipe adds items)")
            key: Any = int(part)
        else:
            section_cls = _section_type(dotted, cls)
            names = [f.name for f in dataclasses.fields(section_cls)] if section_cls is not None else None
            if names is not None and part not in names:
                raise ConfigError(f"command line: unknown key {here!r}; allowed keys under "
                                  f"{dotted or 'the top'}: {', '.join(names)}")
            key = part
        if i == len(path) - 1:
            node[key] = value
            return
        child = node[key] if isinstance(node, list) else node.get(key)
        if isinstance(child, (dict, list)):
            node = child
        elif child is None and not _is_section(here, cls):
            node[key] = {}
            node = node[key]
        else:
            raise ConfigError(f"override {'.'.join(path)}: {here} is not a section")


def _merge(base: dict, new: dict, source, cls, prefix: str = "") -> None:
    """Recursively merge `new` into `base`. Sections merge key by key; free-form values are replaced."""
    for key, value in new.items():
        if key not in base:
            section_name = prefix.rstrip(".") or "the top"
            raise ConfigError(f"{source}: unknown key '{prefix}{key}'; allowed keys under {section_name}: "
                              f"{', '.join(base)}")
        if isinstance(value, dict) and isinstance(base[key], dict) and _is_section(prefix + key, cls):
            _merge(base[key], value, source, cls, prefix + key + ".")
        else:
            base[key] = value


class _RecipeLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key written twice in one mapping: plain YAML keeps the last one silently,
    so a recipe edited in two places would run with whichever came second."""

    def construct_mapping(self, node, deep=False):
        first: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first.get(key)
            except TypeError:  # an unhashable key: the base class raises its own error for it
                continue
            if seen is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is written twice in one mapping (first on line {seen}); remove one",
                    key_node.start_mark)
            first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_recipe_yaml(text: str):
    """A recipe's YAML, parsed safely, with duplicate keys refused (`_RecipeLoader`)."""
    return yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 (a SafeLoader subclass)


def load(cls, path: str | Path | None, overrides: Sequence[str], rules: Sequence[Rule] = ()):
    """Defaults of section `cls`, then the recipe YAML (if any), then `key=value` overrides; every field checked
    against its declaration, then every rule. Nothing is built before this returns."""
    data = to_dict(cls())
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"recipe {path}: no such file" + (" (it is a folder)" if path.is_dir() else ""))
        try:
            recipe = load_recipe_yaml(path.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f" line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"recipe {path}{line}: not valid YAML ({getattr(e, 'problem', e)})") from None
        if not isinstance(recipe, dict):
            raise ConfigError(f"recipe {path}: the top level must be a mapping of sections")
        _merge(data, recipe, path, cls)
        try:  # the recipe on its own, so that an error names the file only when the file holds the bad value
            from_dict(cls, data)
        except ConfigError as e:
            raise ConfigError(f"recipe {path}: {e}") from None
    for text in overrides:
        keys, value = parse_override(text)
        _set_dotted(data, keys, value, cls)
    cfg = from_dict(cls, data)  # a bad value now came from an override (the error names its key)
    check_rules(cfg, rules)
    return cfg


def save_config(cfg, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
