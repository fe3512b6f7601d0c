"""A gpu_check job that runs a check file as its own process and reads its JSON result back (the agent and ReCLIP
checks): its own CUDA context, and a crash or a hang there is one failed entry in the report, not a lost report."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


def run_child(cmd: list[str], out: dict, result_path: Path, log: Path, left: float | None, run_process,
              env: dict) -> dict:
    """Run `cmd` (`run_process(cmd, log, timeout, env)`, gpu_check's) with the time `left` (at most 900 s); `out`
    updated with the command, its wall time and exit code and the JSON it wrote to `result_path`, and `status`
    ok or failed (with the first problem as `error`)."""
    result_path.unlink(missing_ok=True)
    timeout = min(900.0, left or 900.0)
    try:
        rc, seconds = run_process(cmd, log, timeout, env)
    except subprocess.SubprocessError as e:  # pragma: no cover - recorded like a failed case
        return {**out, "status": "failed", "error": str(e), "problems": [str(e)]}
    out.update(command=cmd, log=str(log), wall_s=round(seconds, 1), exit_code=rc)
    if result_path.exists():
        out.update(json.loads(result_path.read_text()))
    elif rc is None:
        out["problems"].append(f"timed out after {timeout:.0f} s")
    else:
        out["problems"].append(f"exit code {rc}, no result (see {log})")
    out["status"] = "failed" if out["problems"] else "ok"
    out["error"] = out["problems"][0] if out["problems"] else None
    return out
