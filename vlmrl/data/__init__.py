"""Data for vlmrl: the sample contract, built-in synthetic tasks, and user files (JSONL, parquet, HF datasets).

A sample is a plain dict with ``id``, ``images`` (RGB PIL images; for user files a ``LazyImages`` that decodes them on
use), ``problem``, ``solution``, ``answer_type`` (``number``/``text``/``box``), ``task`` and any extra columns; see
``vlmrl.data.sample``.
"""

from .files import load_file
from .images import IMAGE_CACHE, LazyImages
from .registry import TASKS, Task, build_dataset, make_task, vocabulary_texts
from .sample import (
    ANSWER_TYPES,
    SPLITS,
    DataError,
    LoadReport,
    Sample,
    check_sample,
    format_box,
    infer_answer_type,
    parse_box,
    parse_number,
)

__all__ = [
    "ANSWER_TYPES",
    "SPLITS",
    "TASKS",
    "DataError",
    "IMAGE_CACHE",
    "LazyImages",
    "LoadReport",
    "Sample",
    "Task",
    "build_dataset",
    "check_sample",
    "format_box",
    "infer_answer_type",
    "load_file",
    "make_task",
    "parse_box",
    "parse_number",
    "vocabulary_texts",
]
