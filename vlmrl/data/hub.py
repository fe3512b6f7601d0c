"""Datasets named on the Hugging Face hub (or saved locally by ``datasets``) as data specs.

A recipe names the dataset, its split and how its columns map to vlmrl's::

    train:
      hub: hiyouga/geometry3k             # a hub name, or a folder written by save_to_disk
      split: train
      columns: {solution: answer}         # vlmrl name: the dataset's column
      image_token: "<image>"

``image_token`` names the marker a dataset writes for an image inside its text (``<image>`` in Geometry3K and MAYE's
data); it is removed from ``problem``, since vlmrl's chat template places the images. ``columns`` renames; the
targets are vlmrl's fields (``image``/``images``, ``problem``, ``solution``, ``answer_type``, ``options``, ``id``,
``task``, or any other name, which passes through to rewards as a column). A dataset column that a mapping replaces
is dropped (MathVista's ``image`` path when ``image: decoded_image``); a dataset's own ``answer_type`` column in
another vocabulary (MathVista's "integer") is an error until the mapping moves it aside. Rows then load exactly as
user files do (``vlmrl.data.files``): single- or multi-image, images decoded when used, every bad row an error
naming the dataset, split and row (or skipped and counted with ``on_error: skip``).

Image columns may hold the images (``datasets.Image``), or paths: relative to ``image_root``, by default to a local
dataset's folder; ``image_root: repo`` reads them from the dataset's hub repository (V* Bench keeps its images as
files beside ``test_questions.jsonl``). Such a path must be relative and stay inside that folder, ``..`` and symlinks
resolved (the rows are someone else's: an absolute path or one that leaves is a bad row, raised or skipped).

Offline-aware: a hub name loads through ``datasets.load_dataset`` (its cache: ``HF_DATASETS_CACHE``). When the hub
cannot be reached (no network, or ``HF_HUB_OFFLINE=1``) a cached dataset loads from the cache with the hub switched
off, and one that is not cached is refused at once, before any model is built, naming the command that fetches it
on a machine with internet (``vlmrl data fetch``) and how to point the recipe at the copy.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from .files import ON_ERROR, RowError, collect_rows, dataset_rows, import_datasets, quietly
from .images import CHECKS
from .sample import ANSWER_TYPES, DataError, LoadReport, Sample

HUB_SPEC_KEYS: tuple[str, ...] = ("hub", "split", "config", "revision", "columns", "image_token", "n", "on_error",
                                  "check_images", "image_root")
REACH_TIMEOUT = 3.0  # seconds to wait for the hub's endpoint before treating the machine as offline
_TRUE = {"1", "ON", "YES", "TRUE"}


def is_local(name: str) -> bool:
    """Whether a ``hub:`` value names a folder on this machine rather than a hub dataset."""
    return Path(name).expanduser().exists() or name.startswith((".", "/", "~"))


def fetch_command(name: str, split: str | None, config: str | None = None) -> str:
    """The command that saves a hub dataset's split as a folder (run where the hub is reachable)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name.split("/")[-1]).lower()
    parts = ["vlmrl data fetch", name]
    if config:
        parts += ["--config", config]
    if split:
        parts += ["--split", split]
    return " ".join(parts + ["--out", f"data/{safe}{'-' + split if split else ''}"])


def offline_reason() -> str | None:
    """Why the hub is unusable here (offline mode set, or its endpoint unreachable within REACH_TIMEOUT), or None."""
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(key, "").upper() in _TRUE:
            return f"{key}={os.environ[key]} is set"
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # the hub is reached through a proxy: a direct connection says nothing; datasets will try
    url = urlparse(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    outcome: list[str | None] = []

    def connect() -> None:  # in a thread: a name lookup has no timeout of its own
        try:
            socket.create_connection((host, port), timeout=REACH_TIMEOUT).close()
            outcome.append(None)
        except OSError as error:
            outcome.append(f"{error.__class__.__name__}: {error}")

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    worker.join(REACH_TIMEOUT + 1.0)
    if not outcome:
        return f"{endpoint} did not answer within {REACH_TIMEOUT + 1.0:.0f} s"
    return None if outcome[0] is None else f"{endpoint} is unreachable ({outcome[0]})"


def cache_dir() -> str:
    """Where ``datasets`` keeps prepared datasets (``HF_DATASETS_CACHE``, read now so a test or user can set it)."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return os.path.expanduser(os.environ["HF_DATASETS_CACHE"])
    import datasets

    return os.path.expanduser(str(datasets.config.HF_DATASETS_CACHE))


def is_cached(name: str) -> bool:
    """Whether ``datasets`` holds a prepared copy of hub dataset ``name`` (the layout its offline loader reads:
    ``<cache>/<namespace>___<name_in_snake_case>/<config>/<version>/<hash>``)."""
    from datasets.naming import camelcase_to_snakecase  # the spelling datasets' cache folders use

    parts = name.split("/")
    parts[-1] = camelcase_to_snakecase(parts[-1])
    root = os.path.join(cache_dir(), "___".join(parts))
    return any(os.path.isdir(p) for p in glob.glob(os.path.join(root, "*", "*", "*")))


@contextlib.contextmanager
def _hub_switched_off() -> Iterator[None]:
    """``datasets`` and ``huggingface_hub`` read their offline flag at import; set it for one load, then restore."""
    import datasets
    import huggingface_hub.constants as hub_constants

    saved = datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def open_dataset(name: str, split: str | None, config: str | None = None, revision: str | None = None,
                 where: str = "data spec", every_split: bool = False) -> Any:
    """One split of a dataset as a ``datasets.Dataset``: from a local folder (``save_to_disk`` output, one split or a
    DatasetDict, or a folder of data files) or from the hub (through its cache; refused at once when the hub is
    unreachable and the dataset is not cached)."""
    datasets = import_datasets(f"{where}: loading the dataset {name!r}")
    label = f"{name}[{split}]" if split else name
    if is_local(name):
        folder = Path(name).expanduser()
        if not folder.exists():
            raise DataError(f"{where}: no folder {name!r} (relative paths start at {Path.cwd()}); save the dataset "
                            f"there with `{fetch_command(name, split, config)}`")
        if (folder / "dataset_dict.json").exists() or (folder / "state.json").exists():
            dataset = quietly(datasets.load_from_disk, str(folder))
        else:  # a folder of parquet/json/csv files, or a script-free hub repo cloned locally
            try:
                dataset = quietly(lambda: datasets.load_dataset(str(folder), name=config, split=split))
            except Exception as error:  # datasets raises many types for a folder it cannot read
                raise DataError(f"{where}: {name!r} is neither a folder saved by save_to_disk nor a folder of data "
                                f"files datasets can read ({error})") from None
        return dataset if every_split and split is None else _one_split(dataset, label, split, where)
    offline = offline_reason()
    if offline is not None and not is_cached(name):
        raise DataError(
            f"{where}: the hub dataset {label!r} is not in the datasets cache ({cache_dir()}) and the hub cannot be "
            f"reached ({offline}). On a machine with internet run `{fetch_command(name, split, config)}`, copy that "
            f"folder here, and point the spec at it (hub: data/...); or copy the datasets cache over"
        )
    try:
        with _hub_switched_off() if offline is not None else contextlib.nullcontext():
            dataset = quietly(lambda: datasets.load_dataset(name, name=config, split=split, revision=revision))
    except Exception as error:  # network, a missing split or config, a gated dataset: datasets' own message
        raise DataError(f"{where}: could not load {label!r} with datasets ({type(error).__name__}: "
                        f"{str(error)[:400]}); check the name, split (and config), or fetch it with "
                        f"`{fetch_command(name, split, config)}`") from None
    return dataset if every_split and split is None else _one_split(dataset, label, split, where)


def _one_split(dataset: Any, label: str, split: str | None, where: str) -> Any:
    if not isinstance(dataset, dict):  # a Dataset
        return dataset
    splits = list(dataset.keys())
    if split is None and len(splits) == 1:
        return dataset[splits[0]]
    if split not in splits:
        raise DataError(f"{where}: {label!r} has splits {splits}, not {split!r}; set 'split' to one of them")
    return dataset[split]


def check_columns(dataset: Any, needed: list[str], label: str, where: str, hint: str = "") -> None:
    """DataError naming every column in ``needed`` that the dataset lacks, and the columns it has."""
    present = list(getattr(dataset, "column_names", None) or [])
    missing = [c for c in needed if c not in present]
    if missing:
        raise DataError(f"{where}: {label!r} has no column {', '.join(map(repr, missing))} (its columns: "
                        f"{present}){'; ' + hint if hint else ''}")


def renamer(columns: Mapping[str, str]) -> Callable[[dict], dict]:
    """A row transform applying a ``columns`` mapping {vlmrl name: dataset column}: each target takes its source's
    value, and a dataset column named like a target (that is not itself a source) is replaced."""
    sources = set(columns.values())

    def rename(row: dict) -> dict:
        out = {k: v for k, v in row.items() if k not in columns or k in sources}
        for target, source in columns.items():
            out[target] = row[source]
        for source in sources - set(columns):
            out.pop(source, None)  # moved, not copied: `decoded_image` does not also ride along as a column
        return out

    return rename


def load_hub(spec: Mapping[str, Any], where: str = "data spec", default_on_error: str = "raise",
             transform: Callable[[dict], Any] | None = None,
             needed: list[str] | None = None) -> tuple[list[Sample], LoadReport]:
    """Samples of a ``{hub: ...}`` spec (see the module docstring); ``transform`` (a benchmark's adapter) runs after
    the column mapping and may return several rows, or raise ``RowError`` for a bad one; ``needed``: dataset
    columns it reads (checked before any row is)."""
    name, split = spec.get("hub"), spec.get("split")
    _check_spec(spec, where)
    dataset = open_dataset(str(name), split, spec.get("config"), spec.get("revision"), where)
    label = f"{name}[{split}]" if split else str(name)
    columns = dict(spec.get("columns") or {})
    check_columns(dataset, list(dict.fromkeys([*columns.values(), *(needed or [])])), label, where,
                  "fix the 'columns' mapping {vlmrl name: dataset column}" if columns else "")
    rename = renamer(columns) if columns else None
    marker = spec.get("image_token")

    def row_of(row: dict) -> Any:
        row = rename(row) if rename else row
        if marker and isinstance(row.get("problem"), str):
            row = {**row, "problem": row["problem"].replace(marker, "").strip()}
        if transform is None and row.get("answer_type") not in (None, *ANSWER_TYPES):
            raise RowError(f"the dataset's own 'answer_type' ({row['answer_type']!r}) is not one of vlmrl's "
                           f"{list(ANSWER_TYPES)}; move it aside with columns: {{source_answer_type: answer_type}}")
        return transform(row) if transform else row

    rows = dataset_rows(dataset, label, row_of)
    base = image_base(str(name), spec.get("image_root"), spec.get("revision"), where)
    stem = str(name).rstrip("/").split("/")[-1]
    try:  # the rows are someone else's: their image paths must stay inside the image root
        return collect_rows(rows, label, stem, base, spec.get("on_error", default_on_error),
                            n=spec.get("n"), check_images=spec.get("check_images", "header"),
                            confine=repository_folder(base))
    finally:
        rows.close()


def _check_spec(spec: Mapping[str, Any], where: str) -> None:
    for key in spec:
        if key not in HUB_SPEC_KEYS:
            raise DataError(f"{where} (hub {spec.get('hub')!r}): unknown key {key!r}; allowed keys: "
                            f"{list(HUB_SPEC_KEYS)}")
    if not isinstance(spec.get("hub"), str) or not spec["hub"]:
        raise DataError(f"{where}: 'hub' must be a dataset name (owner/name) or a folder, got {spec.get('hub')!r}")
    for key in ("split", "config", "revision", "image_root", "image_token"):
        if spec.get(key) is not None and not isinstance(spec[key], str):
            raise DataError(f"{where}: '{key}' must be a string, got {spec[key]!r}")
    columns = spec.get("columns")
    if columns is not None and (not isinstance(columns, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in columns.items())):
        raise DataError(f"{where}: 'columns' must map vlmrl names to dataset columns, e.g. "
                        f"{{problem: question, solution: answer}}, got {columns!r}")
    if spec.get("on_error", "raise") not in ON_ERROR:
        raise DataError(f"{where}: on_error must be one of {list(ON_ERROR)}, got {spec['on_error']!r}")
    if spec.get("check_images", "header") not in CHECKS:
        raise DataError(f"{where}: check_images must be one of {list(CHECKS)}, got {spec['check_images']!r}")
    limit = spec.get("n")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise DataError(f"{where}: n must be a non-negative int, got {limit!r}")


def image_base(name: str, image_root: str | None, revision: str | None = None, where: str = "data spec") -> Path:
    """The folder image paths in the rows are relative to: ``image_root``; for ``image_root: repo`` the dataset's
    own repository (a local folder, or the hub snapshot, which offline must already be downloaded); by default a
    local dataset's folder, or the working directory."""
    if image_root == "repo" and not is_local(name):
        from huggingface_hub import snapshot_download

        offline = offline_reason()
        try:
            return Path(snapshot_download(name, repo_type="dataset", revision=revision,
                                          local_files_only=offline is not None))
        except Exception as error:  # not downloaded while offline, a network error, a gated repository
            raise DataError(f"{where}: the image files of {name!r} are in its hub repository, which is not downloaded "
                            f"{'and the hub cannot be reached (' + offline + ')' if offline else f'({error})'}; on a "
                            f"machine with internet run `vlmrl data fetch {name} --files --out data/"
                            f"{name.split('/')[-1].lower()}` and use that folder") from None
    if image_root and image_root != "repo":
        return Path(image_root).expanduser().absolute()
    return (Path(name).expanduser() if is_local(name) else Path(".")).absolute()


def repository_folder(base: Path) -> Path:
    """The folder a dataset's image paths must stay inside: ``base``, or for a snapshot in the hub cache
    (``<repo>/snapshots/<revision>``, whose files are symlinks to ``<repo>/blobs``) the repository's cache folder."""
    if base.parent.name == "snapshots" and (base.parent.parent / "blobs").is_dir():
        return base.parent.parent
    return base


def fetch_files(name: str, out: str | Path, revision: str | None = None) -> Path:
    """Download a hub dataset's whole repository (its data files and the image files they name) into ``out``."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, repo_type="dataset", revision=revision, local_dir=str(out)))


def save_split(name: str, out: str | Path, split: str | None = None, config: str | None = None,
               revision: str | None = None) -> tuple[Path, int]:
    """Fetch one split of a hub dataset (through the cache) and save it with ``save_to_disk`` at ``out``, for a
    machine without internet; returns (folder, rows)."""
    dataset = open_dataset(name, split, config, revision, "vlmrl data fetch", every_split=True)
    folder = Path(out)
    quietly(dataset.save_to_disk, str(folder))
    rows = sum(len(part) for part in dataset.values()) if isinstance(dataset, dict) else len(dataset)
    return folder, rows


__all__ = ["HUB_SPEC_KEYS", "RowError", "check_columns", "fetch_command", "fetch_files", "image_base", "is_cached",
           "load_hub", "offline_reason", "open_dataset", "repository_folder", "save_split"]
