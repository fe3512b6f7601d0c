"""Each seed paper's recipe (recipes/*.yaml naming a hub dataset) runs 2 RL steps on the tiny model with its own data
spec pointed at a schema fixture, through `vlmrl train RECIPE KEY=VALUE ...` as a user overrides it; and a recipe
whose hub dataset is neither cached nor reachable is refused in seconds, naming the command that fetches it."""

import json
import time
from pathlib import Path

import pytest

from tests import hub_fixtures
from vlmrl.cli import main

pytest.importorskip("datasets")

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
# the GPU settings of a seed recipe, replaced by the tiny model's and tiny budgets (what changes is said here only)
TINY = ["model.name_or_path=tiny", "model.device=cpu", "model.dtype=float32", "model.min_pixels=3136",
        "model.max_pixels=7056", "model.gradient_checkpointing=false", "model.freeze_vision=false",
        "model.freeze_projector=false", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
        "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=64",
        "model.tiny.vision_depth=1", "model.tiny.vision_dim=32", "model.tiny.vision_heads=2",
        "model.tiny.vocab_size=400", "model.tiny.min_pixels=3136", "model.tiny.max_pixels=7056",
        "rollout.engine=hf", "rollout.prompts_per_step=2", "rollout.max_new_tokens=16", "trainer.steps=2",
        "trainer.warmup_steps=0", "trainer.minibatches=1", "trainer.micro_batch=0", "trainer.distributed=none", "trainer.eval_every=0",
        "trainer.save_every=0", "trainer.threads=1", "trainer.tensorboard=false", "eval.max_new_tokens=16",
        "eval.samples=1", "eval.temperatures=[0.0]", "eval.batch_size=8", "data.eval.n=2"]

SEEDS = {  # recipe: (fixture builder for data.train, for data.eval, extra overrides)
    "visual_rft_flower_4shot": (hub_fixtures.virft_classification, hub_fixtures.virft_classification,
                                ["rollout.group_size=2"]),
    "r1v_clevr_counting": (hub_fixtures.clevr_counting, hub_fixtures.superclevr, ["rollout.group_size=2"]),
    "easyr1_geometry3k": (hub_fixtures.geometry3k, hub_fixtures.geometry3k, ["rollout.group_size=2"]),
    "maye_geometry3k": (hub_fixtures.geometry3k, hub_fixtures.geometry3k, []),
}


@pytest.mark.parametrize("recipe", sorted(SEEDS))
def test_seed_recipe_runs_two_steps_on_a_schema_fixture(recipe, tmp_path):
    train_fixture, eval_fixture, extra = SEEDS[recipe]
    train_dir = train_fixture(tmp_path / "train")
    eval_dir = eval_fixture(tmp_path / "eval")
    run = tmp_path / "run"
    overrides = [*TINY, *extra, f"data.train.hub={train_dir}", f"data.eval.hub={eval_dir}",
                 f"trainer.output_dir={run}"]
    assert main(["train", str(RECIPES / f"{recipe}.yaml"), *overrides]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "train"] == [1, 2]
    config = (run / "config.yaml").read_text()
    assert str(train_dir) in config and "Qwen" not in config  # the recipe ran with its data spec pointed here


def test_recipe_naming_an_uncached_hub_dataset_offline_is_refused_in_seconds(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))  # an empty cache
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: the hub is unreachable
    for key in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    run = tmp_path / "run"
    start = time.monotonic()
    code = main(["train", str(RECIPES / "r1v_clevr_counting.yaml"), *TINY, f"trainer.output_dir={run}"])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - start < 20
    assert "leonardPKU/clevr_cogen_a_train[train]" in err and "not in the datasets cache" in err
    assert "vlmrl data fetch leonardPKU/clevr_cogen_a_train --split train --out data/clevr_cogen_a_train-train" in err
    assert not run.exists()  # refused before a run directory or a model
