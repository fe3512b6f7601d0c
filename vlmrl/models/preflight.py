"""What every command checks before it does any work: that a model reference names something loadable and that the
configured device exists. Each failure is one line that says what to do.

A model reference is what `vlmrl eval`, `vlmrl export` and `model.name_or_path` take: a run directory (its latest
complete checkpoint), a checkpoint, a model folder, or a Hugging Face hub name. A path that does not exist is "no
such folder" with the closest run directories, never a hub lookup; a hub name that is neither cached nor reachable
says how to get the weights onto this machine.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

from vlmrl.errors import ConfigError, PathError
from vlmrl.rundir import checkpoint_problem, checkpoint_step, complete_checkpoints

HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name, as the hub spells repository ids
MODEL_FILES = ("config.json", "adapter_config.json")  # a model folder, or LoRA adapters naming their base


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's step checkpoints whose save finished (their COMPLETE marker is written last), oldest first."""
    return complete_checkpoints(run_dir)


def is_model_folder(path: Path) -> bool:
    return any((path / name).is_file() for name in MODEL_FILES)


def resolve_model(ref: str | Path, what: str = "model") -> str | Path:
    """The folder (or hub name) to load for `ref`; PathError when there is none. `what` names the argument in
    messages (e.g. "model.name_or_path", "vlmrl eval CHECKPOINT")."""
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir():
            raise PathError(f"{what}: {ref} is a file; give a run directory, a checkpoint or a model folder")
        if is_model_folder(path):
            _check_complete(path, what)
            return path
        done = checkpoints(path)
        if done:
            return done[-1]
        if any(path.glob("checkpoint-*")) or (path / "metrics.jsonl").exists():
            raise PathError(f"{what}: the run directory {ref} has no complete checkpoint yet (a checkpoint is "
                            f"complete once its save finished); wait for one or pass a model folder")
        raise PathError(f"{what}: {ref} is a folder but not a model (no {' or '.join(MODEL_FILES)}) and not a run "
                        f"directory (no checkpoint-N inside)")
    if HUB_NAME.match(str(ref)) and not Path(str(ref).split("/")[0]).is_dir():
        return _hub(str(ref), what)
    raise PathError(f"{what}: {ref}: no such folder{_closest(path)}")


def _check_complete(path: Path, what: str) -> None:
    """PathError for a run's checkpoint-N whose save did not finish (its weights may be half written)."""
    if checkpoint_step(path) is None:
        return  # a model folder, not a step checkpoint
    problem = checkpoint_problem(path)
    if problem is not None:
        done = checkpoints(path.parent)
        newest = f"; the newest complete one is {done[-1]}" if done else ""
        raise PathError(f"{what}: {path} is not a complete checkpoint ({problem}){newest}")


def _closest(path: Path) -> str:
    """'; closest existing: a, b' from the run directories and model folders beside `path` and under ./runs."""
    pools = [path.parent if str(path.parent) not in ("", ".") else Path("."), Path("runs")]
    names = {str(p) for pool in pools if pool.is_dir() for p in pool.iterdir()
             if p.is_dir() and (is_model_folder(p) or any(p.glob("checkpoint-*")))}
    close = difflib.get_close_matches(str(path), sorted(names), n=3, cutoff=0.6)
    return f"; closest existing: {', '.join(close)}" if close else ""


def _hub(name: str, what: str) -> str:
    """`name` when its weights are in the local hub cache or the hub answers for it; else a PathError saying how
    to get them."""
    import huggingface_hub as hub

    if isinstance(hub.try_to_load_from_cache(name, "config.json"), str):  # cached: transformers loads it offline
        return name
    how = (f"download it on a machine with access (`hf download {name} --local-dir DIR`), copy DIR here and pass "
           + (f"{what}=DIR" if "." in what else "the folder DIR instead"))
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise PathError(f"{what}: {name} is not in the local hub cache and HF_HUB_OFFLINE is set; {how}")
    try:
        hub.HfApi().model_info(name, timeout=10)
    except hub.errors.RepositoryNotFoundError:
        raise PathError(f"{what}: {name}: no such folder, and the Hugging Face hub has no model of that name "
                        f"(or it is private: `hf auth login`)") from None
    except hub.errors.GatedRepoError:
        raise PathError(f"{what}: {name} is gated on the hub: accept its licence on huggingface.co and log in "
                        f"(`hf auth login`), or {how}") from None
    except Exception as exc:  # any failure to reach the hub: DNS, proxy, timeout, TLS
        raise PathError(f"{what}: cannot reach the Hugging Face hub for {name} ({type(exc).__name__}); {how}") \
            from None
    return name


def check_device(device: str, key: str = "model.device") -> None:
    """A ConfigError when `device` names an accelerator torch cannot see here."""
    import torch

    kind, _, index = device.partition(":")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{key}={device}: torch sees no CUDA GPU on this machine (torch {torch.__version__}, "
                              f"CUDA build: {torch.version.cuda or 'none'}); use {key}=cpu or install a CUDA torch")
        if index and int(index) >= torch.cuda.device_count():
            raise ConfigError(f"{key}={device}: this machine has {torch.cuda.device_count()} CUDA GPU(s) "
                              f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{key}=mps: torch sees no Apple GPU here; use {key}=cpu")
