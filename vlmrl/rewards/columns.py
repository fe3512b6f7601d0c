"""Reading a reward's keyword columns: each arrives as a list aligned with `completions`, or as one value set in
`RewardSpec.kwargs`, or not at all. Shared by every built-in reward (boxes.py and verifiable.py both)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def per_sample(value: Any, n: int, default: Any) -> list[Any]:
    """A column as n values: missing -> `default` repeated; a scalar (e.g. set once in RewardSpec.kwargs) -> repeated."""
    if value is None:
        return [default] * n
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # a tensor or numpy array
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"column has {len(value)} values for {n} completions")
    return list(value)


def is_missing(value: Any) -> bool:
    """None or a float NaN (how pandas and parquet readers spell a missing cell): no ground truth to compare with."""
    return value is None or (isinstance(value, float) and math.isnan(value))
