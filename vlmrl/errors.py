"""vlmrl's own error types. `vlmrl` commands print these as one line (`error: ...`, exit code 2) because each names
the key, file, line or sample at fault and says what to do; any other exception is a bug and keeps its traceback.

Every class also derives from the built-in type callers caught before (ValueError, RuntimeError, FileNotFoundError),
so library users' `except ValueError` keeps working.
"""

from __future__ import annotations


class VlmrlError(Exception):
    """Base of the errors a user can fix: bad configs, data, paths, models, or a run that cannot go on."""


class ConfigError(VlmrlError, ValueError):
    """A recipe key or value that is not allowed; raised before any model, data or run directory is built."""


class DataError(VlmrlError, ValueError):
    """A data file, row or sample that cannot be used; the message names the file and line or the sample id."""


class PathError(VlmrlError, FileNotFoundError):
    """A path or model name that does not resolve to what the command needs (a run, checkpoint or model folder)."""


class TrainingError(VlmrlError, RuntimeError):
    """Training cannot go on (e.g. K non-finite steps in a row); the message names the step and the likely causes."""


class FatalRewardError(TrainingError):
    """A reward error that must stop training instead of becoming a counted failure (e.g. the judge's API key is
    refused: every later call would fail the same way). Also importable from `vlmrl.rewards`."""
