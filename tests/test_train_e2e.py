"""The whole path on a very small model: SFT -> eval -> RL -> checkpoint -> eval CLI -> exact resume."""

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen2VLForConditionalGeneration

from vlmrl.cli import main
from vlmrl.config import load_config
from vlmrl.trainer.run import Progress, train

# plain GRPO for the tests that run `vlmrl train` itself (without a recipe it runs the quickstart: DAPO's settings)
GRPO = str(Path(__file__).resolve().parents[1] / "recipes/grpo.yaml")
SMALL = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
         "model.tiny.intermediate_size=64", "model.tiny.vision_depth=1", "model.tiny.vision_dim=32",
         "model.tiny.vision_heads=2", "model.tiny.vocab_size=400",
         "model.tiny.min_pixels=3136", "model.tiny.max_pixels=7056",
         "data.train.n=40", "data.sft.n=16", "data.eval.n=8", "sft.steps=2", "sft.batch_size=4",
         "rollout.prompts_per_step=2", "rollout.group_size=3", "rollout.max_new_tokens=6", "eval.max_new_tokens=6",
         "trainer.eval_every=0", "trainer.threads=1"]


def small_config(tmp_path, *extra):
    return load_config(None, SMALL + [f"trainer.output_dir={tmp_path / 'run'}", *extra])


def test_three_step_training_run(tmp_path):
    summary = train(small_config(tmp_path, "trainer.steps=3", "trainer.log_rollouts_every=1"))
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in records if r["phase"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    for r in train_rows:
        assert 0.0 <= r["reward/total/mean"] <= 1.0 and r["vision_forward_calls_rollout"] == 2
        assert torch.isfinite(torch.tensor(r["loss"])) and r["response_length"] >= 1
    assert len([r for r in records if r["phase"] == "sft"]) == 2
    assert {"greedy/accuracy", "sampled/accuracy", "greedy/mean_length"} <= set(summary["final"])
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "config.yaml").exists() and len((run / "rollouts.jsonl").read_text().splitlines()) == 3
    # checkpoints load with plain from_pretrained, and `vlmrl eval` evaluates them
    for ckpt in ("checkpoint-0", "checkpoint-3"):
        Qwen2VLForConditionalGeneration.from_pretrained(run / ckpt)
    out = tmp_path / "eval.json"
    assert main(["eval", str(run / "checkpoint-3"), "--n", "6", "--temperatures", "0", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["T=0.0"]["n"] == 6


def test_runs_are_never_overwritten_and_say_where_they_write(tmp_path):
    class Messages(Progress):
        def __init__(self):
            self.lines = []

        def message(self, text):
            self.lines.append(text)

    cfg = small_config(tmp_path, "trainer.steps=1", "sft.steps=0")
    said = [Messages(), Messages()]
    first, second = train(cfg, said[0]), train(cfg, said[1])
    assert first["run_dir"] != second["run_dir"] and second["run_dir"].endswith("run-2")
    # each run names its directory first, and the second says why it is not trainer.output_dir itself
    assert said[0].lines[0] == f"run directory: {tmp_path / 'run'}"
    assert said[1].lines[0].startswith(f"run directory: {tmp_path / 'run-2'} ({tmp_path / 'run'} exists and is not "
                                       "empty, and runs are never overwritten")


def test_same_seed_same_numbers_and_exact_resume(tmp_path):
    """Invariant 6 (docs/concepts.md): a run is reproducible, and resuming from a checkpoint continues it exactly."""
    straight = train(small_config(tmp_path / "a", "trainer.steps=4"))
    again = train(small_config(tmp_path / "b", "trainer.steps=4"))
    half = train(small_config(tmp_path / "c", "trainer.steps=4", "trainer.save_every=2"))
    resumed = train(small_config(tmp_path / "c", "trainer.steps=4"), resume=tmp_path / "c/run/checkpoint-2")

    def weights(summary):
        return Qwen2VLForConditionalGeneration.from_pretrained(summary["checkpoint"]).state_dict()

    def train_metrics(run_dir):
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if r["phase"] == "train"}

    w_straight = weights(straight)
    for other in (again, resumed):
        w = weights(other)
        assert all(torch.equal(w_straight[k], w[k]) for k in w_straight)
    assert half["final"] != {} and train_metrics(tmp_path / "a/run") == train_metrics(tmp_path / "b/run")
    # the resumed run logged steps 3 and 4 again, with the same losses as the straight run
    straight_losses = train_metrics(tmp_path / "a/run")
    resumed_rows = [json.loads(x) for x in (tmp_path / "c/run/metrics.jsonl").read_text().splitlines()]
    last = {r["step"]: r["loss"] for r in resumed_rows if r["phase"] == "train"}
    assert last[3] == pytest.approx(straight_losses[3], abs=0) and last[4] == pytest.approx(straight_losses[4], abs=0)


def test_bad_rows_stop_training_or_are_skipped_and_reported(tmp_path, capsys):
    assert main(["data", "export", "shapes_count", "--n", "6", "--out", str(tmp_path / "d")]) == 0
    data = tmp_path / "d/shapes_count-train.jsonl"
    rows = data.read_text().splitlines()
    rows.insert(2, "{not json")
    rows.append(json.dumps({"image": "images/missing.png", "problem": "How many?", "solution": "1"}))
    data.write_text("\n".join(rows) + "\n")
    spec = f"data.train={{path: {data}}}"
    args = ["train", *SMALL, f"trainer.output_dir={tmp_path / 'run'}", "trainer.steps=1", "sft.steps=0", spec]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "shapes_count-train.jsonl" in err and "line 3" in err
    assert not (tmp_path / "run").exists()  # stopped before a run directory or a model was made
    assert main(args + ["data.on_error=skip"]) == 0
    out = capsys.readouterr().out
    assert "skipped 2 bad data rows" in out and "line 3" in out and "missing.png" in out
