"""Recipes are typed and validated: a typo fails early, naming the key and what is allowed."""

from pathlib import Path

import pytest

from vlmrl.config import Config, ConfigError, load_config, parse_override

ROOT = Path(__file__).resolve().parents[1]


def test_vlmrl_train_without_a_recipe_runs_the_packaged_quickstart(monkeypatch):
    from vlmrl import cli
    from vlmrl.config import QUICKSTART

    assert (ROOT / "recipes/quickstart.yaml").resolve() == QUICKSTART  # one file, linked from recipes/
    quickstart = load_config(QUICKSTART)
    assert quickstart != Config() and quickstart.algorithm.dynamic_sampling  # library defaults stay plain GRPO
    assert quickstart.data.eval["n"] >= 600  # 95% intervals of at most +-4 points
    seen = {}
    monkeypatch.setattr("vlmrl.trainer.run.train", lambda cfg, *a, **k: seen.setdefault("cfg", cfg) and 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cli.main(["train", "trainer.seed=3"])
    assert seen["cfg"] == load_config(QUICKSTART, ["trainer.seed=3"])


def test_every_recipe_validates():
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        if not recipe.name.startswith("reclip"):  # ReCLIP recipes have their own config (tests/test_reclip*.py)
            load_config(recipe)


def test_dotted_overrides_are_typed():
    cfg = load_config(None, ["trainer.lr=1e-5", "rollout.group_size=4", "model.max_pixels=3136",
                             "data.eval.n=17", "algorithm.advantage_scale=none"])
    assert cfg.trainer.lr == 1e-5 and isinstance(cfg.trainer.lr, float)
    assert cfg.rollout.group_size == 4 and cfg.model.max_pixels == 3136
    assert cfg.data.eval == {"task": "shapes_count", "n": 17}
    assert cfg.algorithm.advantage_scale == "none"


def test_unknown_key_names_key_and_allowed_keys(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(recipe)
    assert "trainer.lrr" in str(e.value) and "lr_schedule" in str(e.value) and "r.yaml" in str(e.value)
    with pytest.raises(ConfigError, match="rollout.groupsize"):
        load_config(None, ["rollout.groupsize=4"])
    with pytest.raises(ConfigError, match="unknown key 'trainr'"):
        load_config(None, ["trainr.lr=1"])


def test_bad_value_names_allowed_values():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm.loss_aggregation=mean"])
    assert "'token-mean'" in str(e.value) and "seq-mean-token-sum-norm" in str(e.value)
    with pytest.raises(ConfigError, match="trainer.steps: 'ten' is not allowed; expected an integer >= 0"):
        load_config(None, ["trainer.steps=ten"])
    with pytest.raises(ConfigError, match="expected true or false"):
        load_config(None, ["trainer.tensorboard=3"])


def test_rewards_list_is_typed(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rewards:\n  - {name: accuracy, weight: 0.5}\n  - {name: format, wieght: 1}\n")
    with pytest.raises(ConfigError, match=r"rewards\[1\]"):
        load_config(recipe)


def test_dotted_overrides_reach_list_items():
    recipe = ROOT / "recipes/quickstart_judge.yaml"
    cfg = load_config(recipe, ["rewards.1.kwargs.base_url=http://10.0.0.5:8000/v1", "rewards.0.weight=2.0",
                               "rewards.1.label=grader"])
    assert cfg.rewards[1].kwargs["base_url"] == "http://10.0.0.5:8000/v1" and cfg.rewards[1].kwargs["model"] == "judge"
    assert cfg.rewards[0].weight == 2.0 and cfg.rewards[1].label == "grader"  # a key the recipe's item did not set
    assert load_config(None, ["rewards.0.kwargs.strict=false"]).rewards[0].kwargs == {"strict": False}
    with pytest.raises(ConfigError, match=r"'rewards\.2' is out of range: rewards is a list of 2 item\(s\), its "
                                          r"items are rewards\.0 to rewards\.1"):
        load_config(recipe, ["rewards.2.kwargs.base_url=http://x/v1"])
    with pytest.raises(ConfigError, match=r"'rewards\.first' is out of range"):
        load_config(recipe, ["rewards.first.weight=1"])
    with pytest.raises(ConfigError, match=r"unknown key 'rewards\.1\.wieght'; allowed keys under rewards\.1: name, "
                                          r"weight, kwargs, label"):
        load_config(recipe, ["rewards.1.wieght=1"])
    with pytest.raises(ConfigError, match=r"rewards\[1\]\.weight: 'heavy' is not allowed; expected a number"):
        load_config(recipe, ["rewards.1.weight=heavy"])


def test_override_syntax():
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("trainer.lr=3e-4") == (["trainer", "lr"], 3e-4)
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("trainer.lr")


def test_typo_fails_before_any_model_is_built(tmp_path, monkeypatch):
    """`vlmrl train` with a typo'd key exits with an error and creates no run directory."""
    from vlmrl.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", f"trainer.output_dir={tmp_path / 'run'}", "sft.stepz=3"]) == 2
    assert not (tmp_path / "run").exists()


def test_recipe_reference_lists_every_key():
    """docs/recipes.md is generated from the config; regenerate it (scripts/gen_recipe_docs.py) after a change."""
    import dataclasses

    doc = (ROOT / "docs/recipes.md").read_text()

    def keys(cls):
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.type) or f.name in ("model", "data", "sft", "rollout", "algorithm",
                                                              "trainer", "eval", "tiny", "rewards", "lora"):
                continue
            yield f.name

    from vlmrl import config as C

    for cls in (C.ModelConfig, C.TinyModelConfig, C.DataConfig, C.SFTConfig, C.RolloutConfig, C.AlgorithmConfig,
                C.RewardConfig, C.TrainerConfig, C.EvalConfig):
        for name in keys(cls):
            rows = [line for line in doc.splitlines() if line.startswith(f"| `{name}` |")]
            assert rows, f"{cls.__name__}.{name} missing from docs/recipes.md"
            assert any(f"`{getattr(cls(), name)!r}`" in row for row in rows), f"{cls.__name__}.{name}: stale default"
