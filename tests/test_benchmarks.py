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
sys.path.insert(0, str(BENCH))
from smoke import SMOKE  # noqa: E402

# benchmarks/ files that are not benchmarks: shared code, tested through the scripts that use it
HELPERS = {"load_driver.py", "smoke.py", "gpu_check_drift.py", "gpu_check_child.py"}
# benchmarks with tests of their own elsewhere
TESTED_ELSEWHERE = {"gpu_check.py": "tests/test_gpu_check.py", "gpu_check_agent.py": "tests/test_gpu_check.py",
                    "gpu_check_reclip.py": "tests/test_gpu_check.py",
                    "reclip_grm.py": "tests/test_reclip_grm.py"}


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
                               "disconnect_stream": "closed", "pixel_bomb": 200, "json_flood": 400, "deep_json": 400,
                               "huge_stop": 400, "forged_turn": 200, "lone_surrogate": 400, "wide_image": 400,
                               "disguised_image": 400, "slow_headers": "closed", "slow_body": 408,
                               "idle_connection": "closed"}  # each reached the check that must refuse it
    outcomes = report["outcomes"]
    assert all(sum(c.values()) for c in outcomes.values()), outcomes  # every kind was sent
    assert not [s for c in outcomes.values() for s in c if s.isdigit() and int(s) >= 500 and s != "503"]
    assert outcomes["bad_json"] == {"400": outcomes["bad_json"]["400"]}
    assert sum(c.get("503", 0) for c in outcomes.values()) > 0 and outcomes["disconnect_body"].get("closed")
    assert report["before"] == report["after"] and report["before"][0] == 200
    assert report["rss_mib"]["peak"] < min(1536, report["rss_mib"]["bound"])  # the bound its flags give
    slow = report["slow_clients"]
    assert slow["status"] == 200 and slow["seconds"] < 30 and report["sigterm_seconds"] < 10


def load_script(name: str):
    """A benchmark script as a module (benchmarks/ on sys.path, as when it runs)."""

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


# ---------------------------------------------------------------------------------------------- every other script
@pytest.fixture(scope="module")
def smoke_start(tmp_path_factory) -> Path:
    """A quickstart SFT start of the smoke model (`vlmrl train trainer.steps=0`): its checkpoint-0."""
    run = tmp_path_factory.mktemp("smoke_start") / "run"
    proc = subprocess.run([sys.executable, "-m", "vlmrl", "train", "trainer.steps=0", "trainer.threads=1", *SMOKE,
                           f"trainer.output_dir={run}"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run / "checkpoint-0"


SMALLEST = {  # script: (its smallest arguments, what its output must show); START: the smoke start, OUT: a folder
    "decode_attention.py": (["--threads", "1", "--repeats", "3"], "|"),
    "canonical_answers.py": (["START", "--prompts", "2", "--answers", "2"], "a served teacher scores them"),
    "decode_sharing.py": (["START", "--prompts", "2", "--group", "2", "--max-new-tokens", "4", "--repeats", "1"],
                          "same tokens: True"),
    "generate_cache.py": (["--checkpoint", "START", "--prompts", "2", "--group", "2", "--repeats", "1"], "|"),
    "shared_prompt_forward.py": (["--prompts", "2", "--group", "2", "--new-tokens", "4", "--repeats", "1"], "|"),
    "sft_step_speed.py": (["--reps", "1", "--steps", "2"], "SFT step"),
    "data_memory.py": (["--code", "now=.", "--rows", "50", "--side", "32", "--n", "10"], "load + use"),
    "mixed_answers_data.py": (["--out", "OUT", "--train", "4", "--sft", "2", "--test", "2"], "test.jsonl: 6 rows"),
    "two_image_data.py": (["--out", "OUT", "--train", "4", "--sft", "2", "--test", "2"], "test.jsonl: 4 rows"),
    "rl_step_walltime.py": (["START", "--steps", "1", "--out", "OUT/run", *SMOKE], "| IV update |"),
    "profile_rl_step.py": (["START", "--steps", "1", "--out", "OUT/run", *SMOKE], "**whole step**"),
}
SLOW = {  # the sweeps and servers, 10-35 s each on a 2-core CPU: run with -m slow
    "served_rm.py": (["--reps", "1", "--rm-steps", "2", "--prompts", "2", "--group", "2"], "| served, concurrency 4 |"),
    "soak_rollout_ranks.py": (["--smoke", "--out", "OUT/soak", "--results", "OUT/soak.json"], "| run | exit |"),
    "algorithms.py": (["--smoke", "--out", "OUT/runs", "--results", "OUT/algorithms.json"], "| dpo_offline |"),
    # (the smoke teacher writes no answer blocks to learn from: the sft_teacher arm runs on a real teacher only)
    "distill_quickstart.py": (["--teacher", "START", "--steps", "2", "--eval-every", "0", "--arms", "rl", "distill",
                               "--out", "OUT/runs", "--results", "OUT/distill.json", *SMOKE], "| distill | 0 |"),
    "agentic_zoom.py": (["--seeds", "0", "--jobs", "1", "--out", "OUT/runs", "--results", "OUT/agentic_zoom.json",
                         *SMOKE, "trainer.steps=2", "trainer.eval_every=0"], "| no tool |"),
    "quickstart_seeds.py": (["--seeds", "0", "--threads", "1", "--control", "--out", "OUT/runs", "--results",
                             "OUT/seeds.json", "--readme", "OUT/readme.json", *SMOKE, "trainer.steps=2",
                             "trainer.eval_every=0"], "README.md quotes its table"),
    "quickstart_control_ood.py": (["--seeds", "1", "--out", "OUT/runs", "--results", "OUT/ood.json", *SMOKE,
                                   "trainer.steps=2", "trainer.eval_every=0", "eval.ood={ood_count: {task: "
                                   "shapes_count, n: 8}, ood_size: {task: shapes_count, n: 8, size: [112, 140], "
                                   "split: test}}"], "SFT control, same wall time"),
    "reclip_vs_infonce.py": (["rl.steps=2", "warmup.steps=2", "warmup.batch_size=8", "rl.batch_size=8",
                              "rl.candidates=4", "rl.bank_size=16", "data.train.n=16", "data.eval.n=8", "--seeds", "0",
                              "--arms", "infonce", "reclip", "negclip", "reclip_nocf", "reclip_log_cf_t2ibank",
                              "--out", "OUT/results.json"], "ReCLIP − NegCLIP (wins)"),
    "reward_overhead.py": (["--reps", "1", "--math-reps", "1"], "math-verify"),
    "training_strategies.py": (["--smoke", "--out", "OUT/runs", "--results", "OUT/strategies.json"], "| replay |"),
    "serve_chat_load.py": (["--requests", "2", "2", "2", "--max-seconds", "10"], "batching"),
    "serve_search_load.py": (["--images", "8", "--train", "16", "--steps", "2", "--requests", "4", "--concurrency",
                              "1", "--max-seconds", "10"], "held-out caption"),
    "vocab_memory.py": (["--code", "now=.", "--smoke", "--limit-gb", "8"], "151,936-token vocabulary"),
    "off_policy.py": (["--smoke", "--out", "OUT/runs", "--results", "OUT/off_policy.json"], "on-policy (sync)"),
    "torchrun_parity.py": (["--smoke", "--out", "OUT/runs", "--results", "OUT/parity.json"], "torchrun x2"),
    "prm_digits.py": (["--smoke", "--rm-sft-steps", "160", "--completer", "rm-base", "--out", "OUT/runs", "--results",
                       "OUT/prm.json"], "the RMs' starting model answering itself"),
    "rm_overoptimisation.py": (["--smoke", "--out", "OUT/runs", "--results", "OUT/rmo.json"], "kl_budget: 4 RL steps"),
    "rm_distill.py": (["--smoke", "--out", "OUT/runs", "--results", "OUT/rmd.json"], "| many, the teacher's preference |"),
    "box_families.py": (["--rows", "16", "--test", "4", "--steps", "2", "--out", "OUT/runs", "--results", "OUT/bf.json"],
                        "| qwen3_vl |"),
}
OWN_TESTS = {"serve_hostile_load.py", "trl_side_by_side.py", "trl_grpo_worker.py", "agent_step_cost.py",
             "agent_env_overlap.py", "vllm_side_by_side.py"}  # the last: tests/test_vllm_real.py (the vLLM env)


def run_smallest(name: str, spec: tuple[list[str], str], start: Path | None, out: Path) -> None:
    args = [str(start) if a == "START" else a.replace("OUT", str(out)) for a in spec[0]]
    proc = run_script(name, *args)
    assert spec[1] in proc.stdout, proc.stdout[-3000:]


def test_every_benchmark_has_a_smallest_mode_a_test_runs():
    scripts = {p.name for p in BENCH.glob("*.py")} - HELPERS - set(TESTED_ELSEWHERE)
    untested = scripts - set(SMALLEST) - set(SLOW) - OWN_TESTS
    assert not untested, f"benchmarks without a smallest mode in a test: {sorted(untested)}"


@pytest.mark.parametrize("name", sorted(SMALLEST))
def test_benchmark_runs_in_its_smallest_mode(name, tmp_path, request):
    start = request.getfixturevalue("smoke_start") if "START" in SMALLEST[name][0] else None
    run_smallest(name, SMALLEST[name], start, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_slower_benchmark_runs_in_its_smallest_mode(name, tmp_path, request):
    start = request.getfixturevalue("smoke_start") if "START" in SLOW[name][0] else None
    run_smallest(name, SLOW[name], start, tmp_path)


@pytest.mark.slow  # ~15 s: an agentic SFT start, then both arms, then the tool-latency rollouts
def test_agent_step_cost_smallest(tmp_path):
    """The agent's step cost and the tool-latency overlap need an SFT start of the agentic recipe (the zoom tool's
    demonstrations)."""
    run = tmp_path / "start"
    proc = subprocess.run([sys.executable, "-m", "vlmrl", "train", "recipes/agentic_zoom.yaml", *SMOKE,
                           "trainer.steps=0", "trainer.threads=1", f"trainer.output_dir={run}"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = run_script("agent_step_cost.py", str(run / "checkpoint-0"), "--steps", "1", "--threads", "1", "--out",
                     str(tmp_path / "runs"), *SMOKE)
    assert "step time ratio tool / no tool" in out.stdout
    out = run_script("agent_env_overlap.py", str(run / "checkpoint-0"), "--latency", "0.01", "--rounds", "1", *SMOKE)
    assert "| 10 ms |" in out.stdout and "NO" not in out.stdout


def test_two_image_rows_ask_about_the_image_they_name(tmp_path):
    """benchmarks/two_image_data.py: each row's box lies on a drawn shape in the image its question names (first or
    second), both places occur, and the file loads as a user's file with two images per row."""
    import sys

    from PIL import Image

    from vlmrl.data import build_dataset

    sys.path.insert(0, str(BENCH))
    from two_image_data import rows

    written = rows("two_box", 12, "train", 0, tmp_path, "train")
    places = set()
    for row in written:
        place = 0 if "in the first image" in row["problem"] else 1
        places.add(place)
        x1, y1, x2, y2 = json.loads(row["solution"])
        image = Image.open(tmp_path / row["images"][place]).convert("RGB")
        assert image.size == (row["width"], row["height"])
        assert image.getpixel(((x1 + x2) // 2, (y1 + y2) // 2)) != (255, 255, 255)  # the shape, not background
    assert places == {0, 1}
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in written))
    samples, _ = build_dataset({"path": str(tmp_path / "rows.jsonl")}, "train", 0, "raise")
    assert len(samples) == 12 and all(len(s["images"]) == 2 and s["answer_type"] == "box" for s in samples)
