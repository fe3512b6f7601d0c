"""Every script in benchmarks/ runs with the current code, in its smallest mode (issue 43 item 8): a benchmark that
no test runs rots as the code moves (trl_side_by_side.py once wrapped a function that had moved). Each test runs a
script as its users do, in a subprocess, and checks what it printed or wrote, not the numbers."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def load_script(name: str):
    """A benchmark script as a module (benchmarks/ on sys.path, as when it runs)."""

    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), BENCH / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trl_side_by_side_matches_what_trl_has_and_its_vlmrl_worker_times_steps(tmp_path):
    """The two sides are matched by turning off in vlmrl what TRL's GRPOTrainer lacks; the TRL worker refuses the
    quickstart as it is (dynamic sampling, the solved filter, the length reward) and takes it with MATCHED. The vlmrl
    worker times the trainer's own step and counts the images the vision tower encodes (it once wrapped a function
    that had moved, and the headline "x TRL" figure stopped running without anyone noticing)."""
    from vlmrl.config import QUICKSTART, load_config

    side, worker = load_script("trl_side_by_side.py"), load_script("trl_grpo_worker.py")
    lacking = worker.unmatched(load_config(QUICKSTART, []))
    assert any("dynamic_sampling" in x for x in lacking) and any("curriculum" in x for x in lacking)
    assert any("rewards" in x for x in lacking)
    assert worker.unmatched(load_config(QUICKSTART, side.matched(256))) == []
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(BENCH / "trl_side_by_side.py"), "_vlmrl_worker", *side.SMOKE,
                           "sft.steps=1", "trainer.steps=2", "trainer.eval_every=0", "trainer.threads=1",
                           f"trainer.output_dir={run}", *side.matched(16)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = json.loads((run / "steps.json").read_text())
    assert len(steps) == 2 and all(s["seconds"] > 0 for s in steps)
    # 2 prompts: each image once in the rollout (its group shares it) and once in the update's forward
    assert [(s["vision_images_rollout"], s["vision_images_update"]) for s in steps] == [(2, 2), (2, 2)]


@pytest.mark.slow  # ~1 min; the vlmrl side and the matching are checked by the test above in the default run
def test_trl_side_by_side_smoke(tmp_path):
    """The whole benchmark, TRL included (the `bench` extra), in its smallest mode: SFT start, a vlmrl and a TRL
    run, the held-out evaluations and the table."""
    pytest.importorskip("trl")
    out = tmp_path / "results.json"
    proc = run_script("trl_side_by_side.py", "--smoke", "--out", str(tmp_path / "runs"), "--results", str(out))
    report = json.loads(out.read_text())
    assert {r["system"] for r in report["runs"]} == {"vlmrl", "trl"} and "rollouts / s" in proc.stdout
    assert all(r["steps"] == 2 and r["rollouts"] == 8 for r in report["runs"])
    assert "algorithm.dynamic_sampling=false" in report["overrides"]
