"""How a recipe names a function: a registered name, "path/to/file.py:function" (a file, relative to the working
directory) or "package.module:function". Rewards, tools, environments, advantage estimators, policy losses and KL
estimators all resolve through `resolve_reference`, so a user extends each the same way: a function in a file of
their own, named in the recipe, with no change to vlmrl.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from vlmrl.errors import ConfigError, PathError

USER_MODULE_PREFIX = "vlmrl_user_"  # sys.modules name of a user's file: vlmrl_user_{stem}_{hash of its path}


def is_file_reference(ref: str) -> bool:
    """True for "path/to/file.py:function" and "package.module:function" (a colon with text on both sides)."""
    target, sep, attr = ref.rpartition(":")
    return bool(sep and target and attr)


def load_file(path: Path) -> Any:
    """Import a Python file as a module, once per absolute path (cached in sys.modules)."""
    path = path.resolve()
    name = f"{USER_MODULE_PREFIX}{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def resolve_reference(ref: str, what: str, registered: dict[str, Any]) -> Any:
    """The callable a recipe names: a key of `registered`, "path/to/file.py:function" (a file path, relative to the
    working directory) or "package.module:function". `what` names it in errors ("reward", "tool", "environment",
    "advantage estimator", ...)."""
    if ref in registered:
        return registered[ref]
    if not is_file_reference(ref):
        raise ConfigError(
            f"unknown {what} {ref!r}; registered {what}s: {', '.join(sorted(registered))}; "
            "or give 'path/to/file.py:function' or 'package.module:function'"
        )
    target, _, attr = ref.rpartition(":")
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise PathError(f"{what} {ref!r}: file {target!r} not found (relative to {Path.cwd()})")
        module = load_file(path)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ConfigError(f"{what} {ref!r}: cannot import module {target!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{what} {ref!r}: {target!r} has no callable {attr!r}")
    return fn
