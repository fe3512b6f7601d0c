"""A user's own advantage estimator, policy loss or KL estimator, named in a recipe as "path/to/file.py:function" (or
"package.module:function"), resolved the way rewards, tools and environments are (`vlmrl.references`) and checked
against its contract when it is loaded, not at the first step that calls it.

Each registry module (advantages.py, losses.py, kl.py) states its contract: the keyword arguments the trainer passes
and what comes back, with the shapes. `load_user_function` checks the signature: the function must accept every
keyword argument of the contract (naming the ones it uses and `**_` for the rest is enough). The registry module
then calls it once on a small made-up batch and checks what comes back (type, shape, finite values), so a mistake is
one error naming the recipe key, the file and what is expected.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from vlmrl.errors import ConfigError, PathError
from vlmrl.references import resolve_reference

DOCS = "docs/algorithms.md, 'Your own estimator or loss'"


def describe(fn: Callable[..., Any]) -> str:
    """`name(signature)` in `file` (or the module when there is no file), for messages."""
    try:
        signature = str(inspect.signature(fn))
    except (TypeError, ValueError):
        signature = "(...)"
    where = inspect.getsourcefile(fn) if inspect.isfunction(fn) else None
    return f"{getattr(fn, '__name__', repr(fn))}{signature} in {where or getattr(fn, '__module__', '?')}"


def load_user_function(ref: str, key: str, what: str, registered: dict[str, Any],
                       kwargs: Sequence[str]) -> Callable[..., Any]:
    """The function `ref` names (a key of `registered` or a file/module reference); for a user's function, a
    ConfigError naming `key` (the recipe key, e.g. "algorithm.advantage"), the file and the contract when it cannot
    be called with the keyword arguments `kwargs`."""
    try:
        fn = resolve_reference(ref, what, registered)
    except (ConfigError, PathError) as exc:
        raise type(exc)(f"{key}: {exc}") from None
    except Exception as exc:  # the user's file itself failed to import (a syntax error, an exception at import)
        raise ConfigError(f"{key}={ref!r}: importing it raised {type(exc).__name__}: {exc}") from exc
    if ref in registered:
        return fn
    try:
        inspect.signature(fn).bind(**dict.fromkeys(kwargs))
    except TypeError as exc:
        a = "an" if what[0] in "aeiou" else "a"
        raise ConfigError(
            f"{key}={ref!r}: {describe(fn)} cannot be called the way {a} {what} is ({exc}); {a} {what} is called "
            f"with the keyword arguments {', '.join(kwargs)}: name the ones it uses and end with **_ for the rest "
            f"({DOCS})") from None
    except ValueError:  # no signature to read (a builtin): the dry run on a made-up batch checks it
        pass
    return fn


def refuse(key: str, ref: str, fn: Callable[..., Any], problem: str, expected: str) -> ConfigError:
    """The error for a user function whose answer on a made-up batch breaks its contract."""
    return ConfigError(f"{key}={ref!r}: {describe(fn)} {problem} on a made-up batch; expected {expected} ({DOCS})")
