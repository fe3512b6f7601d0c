"""Every script in benchmarks/ runs with the current code, in its smallest mode (issue 43 item 8): a benchmark that
no test runs rots as the code moves (trl_side_by_side.py once wrapped a function that had moved). Each test runs a
script as its users do, in a subprocess, and checks what it printed or wrote, not the numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def run_script(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / name), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)
    assert proc.returncode == 0, f"{name} {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_serve_hostile_load_smoke(tiny_model_dir, tmp_path):
    """A running `vlmrl serve` under the hostile mix: every kind sent, every refusal of its expected kind, no 5xx
    but 503 (the queue bound is loaded too), the same greedy answer after the load as before it."""
    out = tmp_path / "hostile.json"
    proc = run_script("serve_hostile_load.py", "--smoke", "--model", str(tiny_model_dir), "--out", str(out))
    report = json.loads(out.read_text())
    assert report["ok"] and "all checks pass" in proc.stdout
    assert report["alone"] == {"valid": 200, "valid_stream": 200, "long_text": 400, "long_prompt": 400,
                               "oversized_image": 400, "oversized_body": 413, "corrupt_image": 400, "bad_json": 400,
                               "wrong_keys": 400, "disconnect_body": "closed", "disconnect_wait": "closed",
                               "disconnect_stream": "closed"}  # each reached the check that must refuse it
    outcomes = report["outcomes"]
    assert all(sum(c.values()) for c in outcomes.values()), outcomes  # every kind was sent
    assert not [s for c in outcomes.values() for s in c if s.isdigit() and int(s) >= 500 and s != "503"]
    assert outcomes["bad_json"] == {"400": outcomes["bad_json"]["400"]}
    assert sum(c.get("503", 0) for c in outcomes.values()) > 0 and outcomes["disconnect_body"].get("closed")
    assert report["before"] == report["after"] and report["before"][0] == 200
    assert report["rss_mib"]["peak"] < 2048
