"""Seeds, the matched-compute SFT control and OOD splits: aggregation by hand, and the whole path on a tiny model."""

import json

import pytest

from vlmrl.config import load_config
from vlmrl.trainer.control import ood_specs, rl_phase_seconds
from vlmrl.trainer.sweep import aggregate, aggregate_runs, run_seeds

SMALL = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
         "model.tiny.intermediate_size=64", "model.tiny.vision_depth=1", "model.tiny.vision_dim=32",
         "model.tiny.vision_heads=2", "model.tiny.vocab_size=400", "model.tiny.min_pixels=3136",
         "model.tiny.max_pixels=7056", "data.train.n=40", "data.sft.n=16", "data.eval.n=6", "sft.steps=2",
         "sft.batch_size=4", "rollout.prompts_per_step=2", "rollout.group_size=3", "rollout.max_new_tokens=6",
         "eval.max_new_tokens=6", "trainer.threads=1", "trainer.steps=4", "trainer.eval_every=2",
         "trainer.log_rollouts_every=2", "eval.samples=2"]


def test_aggregate_by_hand():
    # mean 0.6; sample std sqrt((0.1^2 + 0.1^2 + 0) / (3 - 1)) = 0.1; max 0.7
    got = aggregate([0.5, 0.7, 0.6])
    assert got["mean"] == pytest.approx(0.6) and got["std"] == pytest.approx(0.1) and got["max"] == 0.7
    assert got["min"] == 0.5 and got["count"] == 3
    # an undefined ratio (None) is left out, not counted as 0
    # mean 0.6, std sqrt((0.2^2 + 0.2^2) / (2 - 1)) = sqrt(0.08)
    assert aggregate([None, 0.4, 0.8]) == {"mean": pytest.approx(0.6), "std": pytest.approx(0.08 ** 0.5), "min": 0.4,
                                           "max": 0.8, "count": 2, "values": [None, 0.4, 0.8]}
    assert aggregate([0.3])["std"] is None and aggregate([None])["mean"] is None


def test_aggregate_runs_flattens_every_eval_metric():
    runs = [{"start": {"greedy/accuracy": 0.2}, "final": {"greedy/accuracy": 0.5},
             "baselines": {"in_distribution": {"control_sft": {"greedy/accuracy": 0.3}},
                           "ood": {"ood": {"rl": {"greedy/accuracy": 0.1, "sampled/reflection/share_correct": None}}},
                           "rl_seconds": 10.0}},
            {"start": {"greedy/accuracy": 0.4}, "final": {"greedy/accuracy": 0.7},
             "baselines": {"in_distribution": {"control_sft": {"greedy/accuracy": 0.5}},
                           "ood": {"ood": {"rl": {"greedy/accuracy": 0.3, "sampled/reflection/share_correct": 0.5}}},
                           "rl_seconds": 12.0}}]
    m = aggregate_runs(runs)
    assert m["final/greedy/accuracy"]["mean"] == pytest.approx(0.6)
    assert m["in_distribution/control_sft/greedy/accuracy"]["max"] == 0.5
    assert m["ood/rl/greedy/accuracy"]["std"] == pytest.approx(0.02 ** 0.5)
    assert m["ood/rl/sampled/reflection/share_correct"]["count"] == 1 and m["rl_seconds"]["mean"] == 11.0


def test_rl_phase_seconds_sums_step_times(tmp_path):
    rows = [{"phase": "eval", "step": 0, "time/x": 100.0},  # evaluations are not training compute
            {"phase": "train", "step": 1, "time/collect_score": 1.5, "time/update": 0.5, "loss": 3.0,
             "time/reward/accuracy": 0.25},  # inside collect_score: not added twice
            {"phase": "train", "step": 2, "time/collect_score": 2.0, "time/update": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert rl_phase_seconds(tmp_path) == pytest.approx(5.0)


def test_ood_specs():
    cfg = load_config(None, [])
    assert ood_specs(cfg) == {"ood": ({"task": "shapes_count", "n": 300}, "ood")}
    cfg = load_config(None, ["eval.ood=null"])
    assert ood_specs(cfg) == {}
    cfg = load_config(None, ["eval.ood={big: {task: shapes_count, n: 5, size: [112, 140], split: test}}"])
    assert ood_specs(cfg) == {"big": ({"task": "shapes_count", "n": 5, "size": [112, 140]}, "test")}
    cfg = load_config(None, ["data.eval={path: x.jsonl}"])
    assert ood_specs(cfg) == {}  # user files have no built-in ood split: give eval.ood
    # a hub dataset's `split` is the dataset's own: it stays in the spec, alone or named
    hub = "{hub: jigsaw-r1/super_clevr, split: test}"
    cfg = load_config(None, [f"eval.ood={hub}"])
    assert ood_specs(cfg) == {"ood": ({"hub": "jigsaw-r1/super_clevr", "split": "test"}, "ood")}
    cfg = load_config(None, [f"eval.ood={{clevr: {hub}}}"])
    assert ood_specs(cfg) == {"clevr": ({"hub": "jigsaw-r1/super_clevr", "split": "test"}, "ood")}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep") / "runs"
    cfg = load_config(None, SMALL + [f"trainer.output_dir={root}", "control.steps=3",
                                     "eval.ood={ood: {task: shapes_count, n: 4}, "
                                     "big: {task: shapes_count, n: 4, size: [112, 140], split: test}}"])
    return run_seeds(cfg, 2, control="sft")


def test_seeds_and_control_write_baselines_and_aggregates(sweep):
    root = sweep["root"]
    saved = json.loads(open(f"{root}/seeds.json").read())
    assert saved["seeds"] == [0, 1] and [r.rsplit("/", 1)[1] for r in saved["runs"]] == ["seed0", "seed1"]
    per_seed = [json.loads(open(f"{run}/baselines.json").read()) for run in saved["runs"]]
    for b in per_seed:
        assert set(b["in_distribution"]) == {"start", "rl", "control_sft"}
        assert set(b["ood"]) == {"ood", "big"} and all(set(v) == {"start", "rl", "control_sft"}
                                                       for v in b["ood"].values())
        assert b["control"]["steps"] == 3 and b["ood_sizes"] == {"ood": 4, "big": 4}
        assert "sampled/pass@2" in b["ood"]["big"]["rl"]
    key = "big/control_sft/greedy/accuracy"
    values = [b["ood"]["big"]["control_sft"]["greedy/accuracy"] for b in per_seed]
    assert saved["metrics"][key]["values"] == values
    assert saved["metrics"][key]["mean"] == pytest.approx(sum(values) / 2)
    # the two seeds are different runs of the same data
    assert saved["metrics"]["start/greedy/mean_length"]["count"] == 2


def test_control_logs_a_curve_on_the_rl_axis(sweep):
    run = sweep["runs"][0]
    rows = [json.loads(x) for x in open(f"{run}/control-sft/metrics.jsonl").read().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "sft"] == [1, 2, 3]
    evals = [r for r in rows if r["phase"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4]  # start, RL's eval step 2, the end (RL's 4 steps)
    start = json.loads(open(f"{run}/baselines.json").read())["in_distribution"]["start"]
    assert evals[0]["greedy/accuracy"] == start["greedy/accuracy"]
    assert evals[-1]["sft_steps"] == 3


def test_control_matches_rl_wall_time(tmp_path):
    from vlmrl.trainer.control import train_with_baselines

    cfg = load_config(None, SMALL + [f"trainer.output_dir={tmp_path / 'run'}", "eval.ood=null",
                                     "trainer.eval_every=0"])
    out = train_with_baselines(cfg, "sft")["baselines"]
    rows = [json.loads(x) for x in (tmp_path / "run/control-sft/metrics.jsonl").read_text().splitlines()]
    step_times = [r["time/update"] for r in rows if r["phase"] == "sft"]
    # the control stops at the first step that reaches the RL phase's training time
    assert out["control"]["seconds"] == pytest.approx(sum(step_times))
    assert sum(step_times) >= out["rl_seconds"] > sum(step_times[:-1])
    assert out["ood"] == {} and "control_sft" in out["in_distribution"]


def test_baselines_of_a_finished_run_read_back_from_its_files(sweep):
    from vlmrl.config import load_config as load
    from vlmrl.trainer.control import run_baselines, summary_of_run

    run = sweep["runs"][0]
    summary = summary_of_run(run)
    saved = json.loads(open(f"{run}/baselines.json").read())
    assert summary["start"] == saved["in_distribution"]["start"] and summary["final"] == saved["in_distribution"]["rl"]
    assert summary["checkpoint"].endswith("checkpoint-4")
    with pytest.raises(FileExistsError, match="control-sft exists"):
        run_baselines(load(f"{run}/config.yaml"), summary, "sft")
