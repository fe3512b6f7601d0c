"""benchmarks/gpu_check.py: its CPU dry run end to end (`--device cpu --tiny`, the same code the GPU check runs),
and the pieces that decide "ok": the base-drift measure, the per-case figures and their problems, the published
model configs."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its top level imports the standard library only
    return module


gpu_check = _load_script()  # (it puts benchmarks/ on sys.path)
import gpu_check_agent  # noqa: E402
import gpu_check_drift  # noqa: E402


# -- the dry run --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("gpu_check")
    out = work / "report.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--work", str(work),
                           "--out", str(out)], capture_output=True, text=True, timeout=1500, cwd=ROOT)
    return proc, out


@pytest.mark.slow  # 2.5-4 min: two `vlmrl train` processes on the real vocabulary; its parts are unit-tested below
def test_cpu_dry_run_passes_and_reports_every_figure(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["failed"] == []
    assert report["device"] == "cpu" and report["tiny"] is True
    model = report["models"]["3b"]
    assert model["vocab_size"] == 151936 and model["tie_word_embeddings"] is True  # the real vocabulary
    ran = [c for c in report["cases"] if c["status"] != "skipped"]
    assert sorted((c["mode"], c["engine"], c["launcher"]) for c in ran) == [("full", "hf", "single"),
                                                                            ("lora", "hf", "single")]
    for case in ran:
        assert case["status"] == "ok", case
        assert case["exit_code"] == 0 and case["problems"] == []
        assert case["train_steps"] == report["settings"]["steps"]
        assert math.isfinite(case["step_time_s"]) and case["step_time_s"] > 0
        assert math.isfinite(case["tokens_per_second_per_gpu"]) and case["tokens_per_second_per_gpu"] > 0
        # float32 on CPU: the sampler and the training forward agree to rounding
        assert case["logprob_gap_mean"] is not None and 0 <= case["logprob_gap_mean"] < 1e-3
        assert case["logprob_gap_max"] is not None and math.isfinite(case["logprob_gap_max"])
        assert case["clip_fraction"] is not None and case["clip_fraction"] < 1e-6
        assert case["mismatch_k3"] is not None and 0 <= case["mismatch_k3"] < 1e-6  # (the sampler is the trainer)
        assert case["grad_norm"] > 0  # the spread reward gives non-zero advantages: the weights really move
        assert case["peak_gpu_gb"] is None
        assert Path(case["metrics_file"]).exists() and Path(case["log"]).exists()
    vllm = [c for c in report["cases"] if c["engine"] == "vllm"]
    assert vllm and all(c["status"] == "skipped" and c["reason"] for c in vllm)
    torchrun = [c for c in report["cases"] if c["launcher"] == "torchrun"]
    assert torchrun and all(c["status"] == "skipped" and c["reason"] for c in torchrun)
    drift = report["drift"]
    assert drift["status"] == "ok", drift
    assert drift["max_abs_drift"] == 0.0 and drift["drift_after_first_push"] == 0.0
    assert drift["pushes"] == 100 and drift["tensors_per_push"] > 0
    assert drift["tensors_pushed"] == 100 * drift["tensors_per_push"]
    assert drift["pushed_changed"] > 0 and drift["lora_layers"] > 0
    assert "LoRA base drift" in proc.stdout and "3b/full/hf/1proc" in proc.stdout


# -- the quick check ----------------------------------------------------------------------------------------------
def test_quick_cpu_tiny_passes_and_writes_json_and_table(tmp_path):
    """`--quick --device cpu --tiny`: full fine-tuning and LoRA with the built-in sampler, the drift check, vLLM cases
    skipped with their reason, no torchrun cases; the JSON and the table on disk (~30 s of CPU)."""
    out = tmp_path / "quick.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--quick", "--work",
                           str(tmp_path), "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["quick"] is True and report["stopped"] is None
    assert report["settings"]["pushes"] == 5 and report["settings"]["budget_s"] is None
    assert list(report["models"]) == ["3b"] and report["models"]["3b"]["vocab_size"] == 151936
    assert all(c["launcher"] == "single" for c in report["cases"])
    assert [(c["mode"], c["engine"]) for c in report["cases"]] == [("full", "hf"), ("lora", "hf"), ("full", "vllm"),
                                                                   ("lora", "vllm")]
    for case in report["cases"][:2]:
        assert case["status"] == "ok", case
        assert case["tokens_per_second_per_gpu"] > 0 and case["step_time_s"] > 0
        assert 0 <= case["logprob_gap_mean"] < 1e-3 and case["grad_norm"] > 0
    assert all(c["status"] == "skipped" and c["reason"] for c in report["cases"][2:])
    assert report["drift"]["status"] == "ok" and report["drift"]["max_abs_drift"] == 0.0
    assert report["drift"]["tensors_pushed"] == 5 * report["drift"]["tensors_per_push"] > 0
    assert report["agent"]["status"] == "skipped" and "CUDA" in report["agent"]["reason"]  # vLLM's agent check
    reclip = report["reclip"]  # fp32 and bf16 `vlmrl reclip train` (the CPU run is the reference on a GPU)
    assert reclip["status"] == "ok" and set(reclip["arms"]) == {"cpu_fp32", "bf16"}, reclip
    assert all(len(a["losses"]) == 10 and a["exit_code"] == 0 for a in reclip["arms"].values())
    text = out.with_suffix(".txt").read_text()
    assert "3b/full/hf/1proc" in text and "3b/lora/hf/1proc" in text and "LoRA base drift" in text
    assert "ReCLIP check (cpu): ok" in text
    assert text.strip().splitlines()[-1].startswith("OK")


def _stub_main(monkeypatch, tmp_path, run_case):
    """gpu_check.main with the model build, the cases and the drift check stubbed (the loop and the report only)."""
    monkeypatch.setattr(gpu_check, "build_model_folder", lambda folder, name, *a, **k: {
        "name": name, "folder": str(folder), "params": 1, "vocab_size": 151936, "tie_word_embeddings": True,
        "reused": True})
    monkeypatch.setattr(gpu_check, "run_case", run_case)
    monkeypatch.setattr(gpu_check, "run_drift", lambda args, info, v: {"status": "ok", "model": info["name"],
                                                                       "engine": "stub", "max_abs_drift": 0.0})
    monkeypatch.setattr(gpu_check, "environment", lambda device: {"gpus": [], "vllm": None, "vllm_error": "no vllm"})
    monkeypatch.setattr(gpu_check, "run_reclip_check", lambda *a: {"status": "ok", "error": None, "problems": [],
                                                                   "arms": {}})
    out = tmp_path / "r.json"
    return out, ["--device", "cpu", "--tiny", "--quick", "--work", str(tmp_path), "--out", str(out)]


def test_quick_stopped_mid_case_keeps_every_finished_case(monkeypatch, tmp_path):
    """A check stopped at its time limit (SIGTERM, as from `timeout`, arrives as KeyboardInterrupt) still reports
    every case that finished, in the JSON and the table, and marks the one it stopped."""
    seen = []

    def run_case(case, s, args, info, work, gpu_gb, left=None):
        on_disk = json.loads((tmp_path / "r.json").read_text())  # written before each case starts
        seen.append([c["status"] for c in on_disk["cases"]])
        if case["status"] == "skipped":
            return case
        if case["mode"] == "lora":
            raise KeyboardInterrupt
        case.update(status="ok", wall_s=1.0, tokens_per_second_per_gpu=5.0)
        return case

    out, argv = _stub_main(monkeypatch, tmp_path, run_case)
    assert gpu_check.main(argv) == 130
    assert seen[1][0] == "ok"  # the first case's result was on disk before the second one started
    report = json.loads(out.read_text())
    assert report["ok"] is False and report["stopped"].startswith("interrupted")
    assert [c["status"] for c in report["cases"]] == ["ok", "stopped", "skipped", "skipped"]
    assert report["cases"][0]["tokens_per_second_per_gpu"] == 5.0
    text = out.with_suffix(".txt").read_text()
    assert "3b/full/hf/1proc             ok" in text and "STOPPED" in text


def test_quick_budget_skips_what_does_not_fit(monkeypatch, tmp_path):
    """With --budget a job starts only while the time left covers its plan, and a case may run for the time left."""
    ran, plan = [], gpu_check.QUICK_PLAN_S
    clock = type("Clock", (), {"now": 0.0, "perf_counter": lambda self: self.now})()
    monkeypatch.setattr(gpu_check, "time", clock)

    def run_case(case, s, args, info, work, gpu_gb, left=None):
        if case["status"] != "skipped":
            ran.append((case["name"], left))
            clock.now += plan["full"]  # the full case takes its planned time
            case.update(status="ok")
        return case

    out, argv = _stub_main(monkeypatch, tmp_path, run_case)
    budget = plan["full"] + plan["drift"] - 10  # after the full case: less than LoRA's plan and the drift's
    assert gpu_check.main(argv + ["--budget", str(budget)]) == 0  # the full case fits, then LoRA's plan does not
    assert ran == [("3b/full/hf/1proc", budget)]
    report = json.loads(out.read_text())
    lora = report["cases"][1]
    assert lora["status"] == "skipped" and lora["reason"].startswith("time budget")
    assert report["drift"]["status"] == "skipped" and "time budget" in report["drift"]["reason"]
    # planned GPU time of the quick check (module docstring): under 8 minutes with vLLM absent
    assert plan["startup"] + plan["build"] + plan["full"] + plan["lora"] + plan["drift"] <= gpu_check.QUICK_BUDGET_S
    # the ReCLIP check comes last, and fits the budget without vLLM
    assert sum(plan[k] for k in ("startup", "build", "full", "lora", "drift", "reclip")) <= gpu_check.QUICK_BUDGET_S
    # with vLLM the agent check comes next and still fits the same budget
    assert sum(plan[k] for k in ("startup", "build", "full", "lora", "drift", "agent")) <= gpu_check.QUICK_BUDGET_S
    assert gpu_check.QUICK_BUDGET_S < 8 * 60


def test_help_works():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--tiny" in proc.stdout and "max_abs_drift" in proc.stdout
    assert "--quick" in proc.stdout and "--budget" in proc.stdout


# -- the drift measure and the drift check ------------------------------------------------------------------------
def test_max_drift_sees_an_in_place_change():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(torch.bfloat16)
    snapshot = gpu_check_drift.snapshot_base(model)
    assert gpu_check_drift.max_drift(snapshot, model) == 0.0
    with torch.no_grad():
        model[1].weight[0, 0] += 0.5
    assert gpu_check_drift.max_drift(snapshot, model) == pytest.approx(0.5, rel=1e-2)
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    assert gpu_check_drift.max_drift(snapshot, model) == math.inf
    assert gpu_check_drift.max_drift({**snapshot, "gone.weight": torch.zeros(1)}, model) == math.inf


def _lora_policy(tiny_model_dir):
    pytest.importorskip("peft")
    from vlmrl.config import LoraConfig
    from vlmrl.models import load_policy
    from vlmrl.models.trainable import add_lora

    policy = add_lora(load_policy(tiny_model_dir, "bfloat16"), LoraConfig(r=4), tiny_model_dir)
    assert gpu_check_drift.randomize_lora_b(policy.model) > 0
    return policy


def test_drift_check_passes_the_out_of_place_push(tiny_model_dir):
    policy = _lora_policy(tiny_model_dir)
    engine = gpu_check_drift.standin_engine("cpu")
    result = gpu_check_drift.drift_check(policy, engine, pushes=3)
    assert result["problems"] == [], result
    assert result["max_abs_drift"] == 0.0 and result["tensors_per_push"] > 0 and result["pushed_changed"] > 0
    assert len(engine.llm.loads) == 3 and len(engine.llm.loads[0]) == result["tensors_per_push"]


def test_drift_check_fails_a_push_that_merges_in_place(tiny_model_dir):
    """The planted bug: merge the adapters into W, push W, unmerge. In bf16 W + d - d is not W, and the check says so."""
    policy = _lora_policy(tiny_model_dir)
    engine = gpu_check_drift.standin_engine("cpu")

    def merge_in_place(p):
        p.model.merge_adapter()
        engine._load((gpu_check_drift.base_name(n), t.detach()) for n, t in p.model.named_parameters() if ".lora_" not in n)
        p.model.unmerge_adapter()

    engine.push_weights = merge_in_place
    result = gpu_check_drift.drift_check(policy, engine, pushes=2)
    assert result["max_abs_drift"] > 0 and result["problems"]
    assert "drifted" in result["problems"][0]


def test_drift_check_fails_a_push_without_the_adapters(tiny_model_dir):
    policy = _lora_policy(tiny_model_dir)
    engine = gpu_check_drift.standin_engine("cpu")
    engine.push_weights = lambda p: engine._load(
        (gpu_check_drift.base_name(n), t.detach()) for n, t in p.model.named_parameters() if ".lora_" not in n)
    result = gpu_check_drift.drift_check(policy, engine, pushes=1)
    assert result["max_abs_drift"] == 0.0
    assert any("did not reach the engine" in p for p in result["problems"])


# -- figures and problems -----------------------------------------------------------------------------------------
def _rows(n=3, **extra):
    rows = [{"phase": "eval", "step": 0, "greedy/accuracy": 0.0}]
    for step in range(1, n + 1):
        rows.append({"phase": "train", "step": step, "time/collect_score": 1.0 * step, "time/update": 2.0,
                     "tokens_per_second": 100.0 * step, "rollouts_per_second": 4.0, "clip_fraction": 0.0,
                     "rollout/logprob_gap_mean": 0.01 * step, "rollout/logprob_gap_max": 0.1 * step, "loss": 0.1,
                     "grad_norm": 1.0, "reward/total/mean": 0.5, "memory/peak_gpu_gb": 10.0 + step,
                     "mismatch/k3": 1e-3 * step, **extra})
    return rows


def test_summarize_averages_the_steps_after_the_first():
    f = gpu_check.summarize(_rows())
    assert f["train_steps"] == 3
    assert f["tokens_per_second_per_gpu"] == pytest.approx(250.0)  # steps 2 and 3
    assert f["step_time_s"] == pytest.approx(4.5)
    assert f["peak_gpu_gb"] == 13.0
    assert f["logprob_gap_mean"] == pytest.approx(0.02) and f["logprob_gap_max"] == pytest.approx(0.3)
    assert f["mismatch_k3"] == pytest.approx(2e-3)  # every step's
    assert gpu_check.case_problems(f, 0, 3, cuda=True, max_gap_mean=0.1) == []


def test_case_problems_flag_what_is_not_ok():
    def problems(rows, **kw):
        return gpu_check.case_problems(gpu_check.summarize(rows), 0, 3, kw.get("cuda", True), kw.get("gap", 0.1))

    assert any("train steps" in p for p in problems(_rows(n=2)))
    no_gap = [{k: v for k, v in r.items() if not k.startswith("rollout/")} for r in _rows()]
    assert any("logprob_gap" in p for p in problems(no_gap))
    assert any("gap mean" in p for p in problems(_rows(), gap=0.01))
    assert any("loss" in p for p in problems(_rows(loss=float("nan"))))
    assert any("tokens/s" in p for p in problems(_rows(tokens_per_second=0.0)))
    no_memory = [{k: v for k, v in r.items() if k != "memory/peak_gpu_gb"} for r in _rows()]
    assert any("peak_gpu_gb" in p for p in problems(no_memory))
    assert problems(no_memory, cuda=False) == []
    assert any("train steps" in p for p in problems([]))


def test_last_error_line_finds_the_rank_error():
    text = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
            "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
            "  https://pytorch.org/docs/stable/elastic/errors.html\n")
    assert gpu_check.last_error_line(text).startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert gpu_check.last_error_line("step 1\rstep 2\nall fine\n") == "all fine"


# -- the published configs ----------------------------------------------------------------------------------------
def test_model_configs_are_the_published_ones(tmp_path):
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlmrl.models.memory import KNOWN_CONFIGS

    known = KNOWN_CONFIGS["Qwen/Qwen2.5-VL-3B-Instruct"]
    cfg3 = gpu_check.model_config("3b", tiny=False)
    for key, value in known["text_config"].items():
        if key in cfg3:
            assert cfg3[key] == value, key
    for key, value in known["vision_config"].items():
        assert cfg3["vision_config"][key] == value, key
    # the hub's parameter counts: Qwen2.5-VL-3B-Instruct 3,754,622,976; -7B-Instruct 8,292,166,656 (untied head)
    for name, params in (("3b", 3_754_622_976), ("7b", 8_292_166_656)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(gpu_check.model_config(name, tiny=False)))
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder))
        assert sum(p.numel() for p in model.parameters()) == params, name
    cfg7 = gpu_check.model_config("7b", tiny=False)
    assert cfg7["vocab_size"] == 152064 and cfg7["tie_word_embeddings"] is False
    assert cfg7["rope_scaling"]["mrope_section"] == [16, 24, 24]


# -- the agent check's parts (gpu_check_agent.py), on the built-in sampler ---------------------------------------
def test_agent_check_reaches_every_turn_and_measures_the_gap_per_turn(tiny_model_dir):
    from vlmrl.data import make_task
    from vlmrl.models import load_policy

    policy = load_policy(tiny_model_dir)
    policy.eos_token_ids = gpu_check_agent.end_tokens(policy)  # random weights end turns at these too
    samples = make_task("zoom_shape", 2, "train", seed=0)
    result = gpu_check_agent.agent_arm(policy, samples, None, [1, 2])
    assert [t["turn"] for t in result["per_turn"]] == [0, 1, 2] and result["reached_turn"][2] > 0
    assert result["images_per_trajectory"] > 1.5  # the demonstrated zoom comes back as an image every turn
    assert all(t["tokens"] > 0 and t["gap_mean"] < 1e-3 for t in result["per_turn"])  # float32 on CPU
    assert gpu_check_agent.agent_problems(result, 0.1) == []
    far = {**result, "per_turn": [{**t, "gap_mean": 0.5} for t in result["per_turn"]][:2]}
    problems = gpu_check_agent.agent_problems(far, 0.1)
    assert any("turn 1: log-prob gap mean 0.5" in p for p in problems) and any("turn 2" in p for p in problems)


def test_turn_gaps_by_hand():
    from vlmrl.rollout.generate import Rollout

    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 1, 1, 1, 1]])
    sampled = torch.tensor([[-1.0, -1.0, 0, 0, -2.0, 0], [-1.0, 0, -3.0, -3.0, -3.0, -3.0]])
    trained = sampled + torch.tensor([[0.1, 0.3, 9, 9, 0.5, 9], [0.2, 9, 0.0, 0.4, 0.0, 0.0]])
    r = Rollout(torch.arange(2), torch.zeros_like(mask), mask, sampled, torch.zeros(2, dtype=torch.bool), ["", ""])
    turns = gpu_check_agent.turn_gaps(r, trained)
    assert [(t["turn"], t["tokens"]) for t in turns] == [(0, 3), (1, 5)]
    assert turns[0]["gap_mean"] == pytest.approx(0.2) and turns[1]["gap_max"] == pytest.approx(0.5)


def test_image_push_case_passes_fresh_features_and_fails_stale_ones(tiny_model_dir, count_samples):
    from vlmrl.models import load_policy
    from vlmrl.rollout.generate import generate

    def fresh(policy):
        return lambda prompts, chunk, seed: generate(policy, prompts, 1, 8, 1.0, prompt_seeds=[seed])

    policy = load_policy(tiny_model_dir)
    ok = gpu_check_agent.image_push_case(policy, count_samples[0], fresh(policy), lambda: None, 0.1, 0.1)
    assert ok["problems"] == [] and ok["move_mean"] > 0.1 and ok["gap_after_push_mean"] < 1e-3
    # an engine that keeps the image's features from before the push answers the second call as it did the first
    policy, kept = load_policy(tiny_model_dir), []

    def stale(prompts, chunk, seed):
        kept.append(kept[0] if kept else fresh(policy)(prompts, chunk, seed))
        return kept[-1]

    bad = gpu_check_agent.image_push_case(policy, count_samples[0], stale, lambda: None, 0.1, 0.1)
    assert bad["gap_after_push_mean"] == pytest.approx(bad["move_mean"], rel=1e-3) and bad["move_mean"] > 0.1
    assert len(bad["problems"]) == 1 and "after the push the engine's log-probs are" in bad["problems"][0]
