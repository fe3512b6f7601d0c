"""First contact: every bad value, path or name is refused before any work starts, in one line that says what to do.

The property test is generated from the config's own declarations: for every key, a wrong-typed value and (where
the key declares a range) a value just outside it, given as a dotted override to `vlmrl train`, must exit 2 with a
ConfigError naming the key and what is allowed, create no run directory, and take well under a second.
"""

from __future__ import annotations

import dataclasses
import time
import typing
from typing import Annotated, Any, Literal

import annotated_types as at
import pytest
import yaml

from vlmrl.cli import main
from vlmrl.config import QUICKSTART, RULES, Config, ConfigError, load_config, validate
from vlmrl.configlib import _strip, allowed
from vlmrl.errors import PathError


def leaves(cls, prefix=""):
    """(dotted key, declared type) of every leaf field reachable by a dotted override."""
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls, include_extras=True)[f.name]
        inner = _strip(tp)
        if dataclasses.is_dataclass(inner):
            yield from leaves(inner, f"{prefix}{f.name}.")
        elif typing.get_origin(inner) is list and dataclasses.is_dataclass(typing.get_args(inner)[0]):
            continue  # `rewards`: a list of sections, set in a recipe (tests/test_config.py)
        elif tp is not Any:
            yield prefix + f.name, tp


def _base(tp):
    """The type under Optional, with its Annotated metadata."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if type(None) in typing.get_args(tp) and len(args) == 1:
        return args[0]
    return tp


def bad_values(tp) -> list:
    """A wrong-typed value for `tp`, then the values just outside each declared bound."""
    tp = _base(tp)
    metadata = typing.get_args(tp)[1:] if typing.get_origin(tp) is Annotated else ()
    plain = typing.get_args(tp)[0] if metadata else tp
    wrong = {int: "ten", float: "fast", bool: 3, str: [1, 2], dict: "x"}
    if typing.get_origin(plain) is Literal or any(typing.get_origin(a) is Literal for a in typing.get_args(plain)):
        return ["not-a-choice"]  # a choice, or a choice or a user's "file.py:function" (algorithm.advantage)
    if typing.get_origin(plain) is list:
        return ["not-a-list"]
    out = [wrong[plain]]
    for m in metadata:
        if isinstance(m, at.Ge):
            out.append(m.ge - 1 if plain is int else m.ge - 0.5)
        if isinstance(m, at.Gt):
            out.append(m.gt)
        if isinstance(m, at.Le):
            out.append(m.le + 1)
        if isinstance(m, at.Lt):
            out.append(m.lt)
        if isinstance(m, at.MinLen):
            out.append("")
    return out


CASES = [(key, tp, value) for key, tp in leaves(Config) for value in bad_values(tp)]


def test_every_key_has_cases():
    keys = {key for key, _, _ in CASES}
    assert {"trainer.steps", "rollout.temperature", "rollout.top_p", "model.tiny.hidden_size",
            "algorithm.dual_clip", "eval.pass_k", "model.lora.dropout"} <= keys
    assert len(keys) > 80  # every leaf key of the recipe


@pytest.mark.parametrize("key,tp,value", CASES, ids=[f"{k}={v!r}" for k, _, v in CASES])
def test_out_of_range_or_wrong_type_override_is_refused(key, tp, value, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip() if value != "" else ""
    start = time.perf_counter()
    code = main(["train", f"trainer.output_dir={run}", f"{key}={text}"])
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"error: {key}: ") and err.count("\n") == 1, err
    assert f"expected {allowed(tp)}" in err, err
    assert not run.exists() and list(tmp_path.iterdir()) == []
    assert seconds < 5.0  # refused before any model or data is built (a run takes far longer; loose for loaded CI)


def test_allowed_text_names_the_range():
    hints = typing.get_type_hints(type(Config().rollout), include_extras=True)
    assert allowed(hints["top_p"]) == "a number in (0, 1]"
    assert allowed(hints["group_size"]) == "an integer >= 1"
    assert allowed(hints["engine"]) == "one of 'hf', 'vllm'"
    algo = typing.get_type_hints(type(Config().algorithm), include_extras=True)
    assert allowed(algo["dual_clip"]) == "null or a number > 1"
    assert allowed(typing.get_type_hints(type(Config().eval), include_extras=True)["pass_k"]) \
        == "a list of integers >= 1"


@pytest.mark.parametrize("overrides,match", [
    (["rollout.group_size=1"], r"rollout.group_size=1: the group-relative advantage"),
    (["rollout.group_size=1", "algorithm.advantage=rloo"], r"leave-one-out"),
    (["rollout.group_size=1", "algorithm.advantage=reinforce_pp", "algorithm.reinforce_pp_baseline=group"],
     r"group baseline"),
    (["algorithm.beta=0.1", "algorithm.kl_estimator=k1"], r"k1 as a loss term has zero expected gradient"),
    (["algorithm.beta=0.1", "algorithm.kl_in=reward"], r"kl_estimator=k3 with kl_in=reward.*set "
                                                        r"algorithm.kl_estimator=k1"),
    (["algorithm.policy_loss=reinforce", "trainer.ppo_epochs=2"], r"no importance ratio"),
    (["trainer.minibatches=200"], r"minibatches=200 > the 128 answers"),
    (["trainer.warmup_steps=901"], r"warmup_steps=901 > trainer.steps=900"),
    (["model.min_pixels=5000", "model.max_pixels=4000"], r"min_pixels=5000 > model.max_pixels=4000"),
    (["model.tiny.num_heads=5"], r"hidden_size=96 / num_heads=5"),
    (["model.device=gpu"], r"expected cpu, cuda, cuda:N, mps or xpu"),
    (["rollout.engine=vllm", "model.device=mps"], r"rollout.engine=vllm runs on cuda \(vllm\) or cpu"),
    (["rollout.engine=vllm", "rollout.vllm={sleep: true}"], r"CPU backend has no sleep mode"),
    (["rollout.vllm={max_model_len: 100}"], r"max_model_len=100 < data.max_prompt_length"),
    (["data.sft=null"], r"data.sft is null"),
    (["data.preferences={task: shapes_count, n: 10}", "curriculum.filter_solved=true"], r"trains on fixed pairs"),
    (["data.preferences={task: shapes_count, n: 10}", "replay.weight=0.5"], r"trains on fixed pairs"),
])
def test_rules_between_keys(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_accepted_combinations():
    """What the rules allow: one answer per prompt for REINFORCE++ without a group baseline, k1 as a reward, a
    budget that fits, and every shipped recipe (tests/test_config.py)."""
    load_config(None, ["rollout.group_size=1", "algorithm.advantage=reinforce_pp"])
    load_config(None, ["algorithm.beta=0.1", "algorithm.kl_in=reward", "algorithm.kl_estimator=k1"])
    load_config(None, ["algorithm.beta=0.1", "algorithm.kl_estimator=k2"])
    load_config(None, ["rollout.vllm={max_model_len: 1024}", "trainer.steps=0"])


def test_rules_are_documented():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs/recipes.md").read_text()
    assert all(rule.text in doc for rule in RULES)


def test_validate_checks_configs_changed_in_code():
    cfg = Config()
    cfg.rollout.temperature = -1.0
    with pytest.raises(ConfigError, match="rollout.temperature: -1.0 is not allowed; expected a number > 0"):
        validate(cfg)
    cfg = Config()
    cfg.rollout.group_size = 1
    with pytest.raises(ConfigError, match="group_size=1"):
        validate(cfg)


def test_recipe_errors_name_the_file_and_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  steps: -5\n")
    with pytest.raises(ConfigError, match=r"recipe .*r.yaml: trainer.steps: -5 is not allowed; expected an integer "
                                          r">= 0"):
        load_config(recipe)
    recipe.write_text("trainer:\n  steps: [1\n")
    with pytest.raises(ConfigError, match=r"r.yaml line \d+: not valid YAML"):
        load_config(recipe)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")


def test_a_key_written_twice_in_a_recipe_is_refused_with_both_lines(tmp_path):
    """Plain YAML keeps the second of two equal keys silently; a recipe edited in two places would run with either."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  steps: 5\n  lr: 1.0e-4\n  steps: 7\n")
    with pytest.raises(ConfigError, match=r"r.yaml line 4: .*key 'steps' is written twice in one mapping "
                                          r"\(first on line 2\)"):
        load_config(recipe)
    recipe.write_text("trainer: {steps: 5, steps: 7}\n")  # both on one line, in a flow mapping
    with pytest.raises(ConfigError, match=r"r.yaml line 1: .*key 'steps' is written twice .*\(first on line 1\)"):
        load_config(recipe)
    recipe.write_text("trainer:\n  steps: 5\nsft:\n  steps: 7\n")  # the same name in two sections is fine
    cfg = load_config(recipe)
    assert (cfg.trainer.steps, cfg.sft.steps) == (5, 7)


# ---------------------------------------------------------------------------------------------------------------
# the six first-contact commands: one line, exit code 2, no training work


@pytest.mark.parametrize("override,message", [
    ("rollout.group_size=0", "error: rollout.group_size: 0 is not allowed; expected an integer >= 1"),
    ("trainer.steps=-5", "error: trainer.steps: -5 is not allowed; expected an integer >= 0"),
    ("rollout.temperature=-1", "error: rollout.temperature: -1 is not allowed; expected a number > 0"),
])
def test_bad_train_values(override, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", override]) == 2
    assert capsys.readouterr().err == message + "\n"
    assert list(tmp_path.iterdir()) == []  # no run directory, no data, no model


def fake_checkpoint(path, complete: bool = True):
    """A checkpoint folder as the trainer publishes it: model files, then the COMPLETE marker listing them."""
    import json

    from vlmrl.trainer.checkpoint import MARKER

    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    if complete:
        (path / MARKER).write_text(json.dumps({"files": {"config.json": 2}}))


def test_eval_of_a_missing_folder_is_not_a_hub_lookup(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    fake_checkpoint(tmp_path / "runs" / "quickstart" / "checkpoint-3")
    assert main(["eval", "/nonexistent"]) == 2
    assert capsys.readouterr().err == "error: vlmrl eval: /nonexistent: no such folder\n"
    assert main(["eval", "runs/quickstrat"]) == 2
    assert capsys.readouterr().err == ("error: vlmrl eval: runs/quickstrat: no such folder; closest existing: "
                                       "runs/quickstart\n")
    assert main(["export", "runs/nope", "out"]) == 2
    assert "vlmrl export: runs/nope: no such folder" in capsys.readouterr().err


def test_eval_of_a_run_directory_uses_its_latest_complete_checkpoint(tmp_path, monkeypatch, capsys):
    from vlmrl.models.preflight import resolve_model

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "quickstart"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    assert main(["eval", "runs/quickstart"]) == 2
    assert "has no complete checkpoint yet" in capsys.readouterr().err
    for step in (0, 20, 100):
        fake_checkpoint(run / f"checkpoint-{step}")
    fake_checkpoint(run / "checkpoint-120", complete=False)  # a save that never finished
    assert resolve_model("runs/quickstart") == run.relative_to(tmp_path) / "checkpoint-100"
    assert resolve_model(run / "checkpoint-20") == run / "checkpoint-20"
    with pytest.raises(PathError, match=r"checkpoint-120 is not a complete checkpoint \(no COMPLETE marker .*the "
                                        r"newest complete one is .*checkpoint-100"):
        resolve_model(run / "checkpoint-120")


def test_an_unreachable_hub_name_says_how_to_get_the_weights(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    monkeypatch.chdir(tmp_path)

    def offline(*args, **kwargs):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", offline)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert main(["train", "model.name_or_path=Qwen/Qwen2.5-VL-3B-Instruct"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model.name_or_path: cannot reach the Hugging Face hub for "
                          "Qwen/Qwen2.5-VL-3B-Instruct (ConnectionError); download it on a machine with access "
                          "(`hf download Qwen/Qwen2.5-VL-3B-Instruct --local-dir DIR`)"), err
    assert err.count("\n") == 1 and list(tmp_path.iterdir()) == []
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["eval", "Qwen/Qwen2.5-VL-3B-Instruct"]) == 2
    assert "not in the local hub cache and HF_HUB_OFFLINE is set" in capsys.readouterr().err


def test_a_gpu_device_on_a_machine_without_one_is_refused(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["train", "model.device=cuda"]) == 2
    assert "model.device=cuda: torch sees no CUDA GPU on this machine" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_what_torchrun_cannot_run_is_refused_before_sft(tmp_path, monkeypatch, capsys):
    """Under torchrun with 2 processes what it cannot split over the ranks (here a replay batch) is refused up front, not
    after SFT and the first evaluation; the quickstart's dynamic sampling and curriculum run there."""
    import vlmrl.trainer.run as run
    from vlmrl.trainer.distributed import DistInfo
    from vlmrl.trainer.job import check_distributed

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run, "init_distributed", lambda mode, device, **_: DistInfo(mode, 0, 2, 0, "cpu"))
    assert main(["train", "trainer.distributed=ddp", "replay.weight=0.1", "replay.batch_size=7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: replay.batch_size=7 must be a multiple of the number of processes (2) under "
                          "torchrun"), err
    assert list(tmp_path.iterdir()) == []
    quickstart = load_config(QUICKSTART)  # dynamic sampling and the curriculum's filter
    assert quickstart.algorithm.dynamic_sampling and quickstart.curriculum.active
    check_distributed(quickstart, DistInfo("ddp", 0, 2, 0, "cpu"))
    plain = Config()
    check_distributed(plain, DistInfo("ddp", 0, 2, 0, "cpu"))  # plain GRPO runs under DDP
    agentic = load_config(QUICKSTART.parents[2] / "recipes" / "agentic_zoom.yaml")
    assert agentic.agent.enabled
    check_distributed(agentic, DistInfo("fsdp2", 0, 2, 0, "cpu"))  # agents run under torchrun
    with_replay = Config()
    with_replay.replay.weight, with_replay.replay.batch_size = 0.1, 8
    check_distributed(with_replay, DistInfo("ddp", 0, 2, 0, "cpu"))  # SFT replay and a critic run too
    with_replay.algorithm.advantage = "gae"
    check_distributed(with_replay, DistInfo("fsdp2", 0, 2, 0, "cpu"))
    with_replay.data.preferences = {"task": "shapes_count", "n": 8}
    check_distributed(with_replay, DistInfo("ddp", 0, 2, 0, "cpu"))  # and offline DPO
    plain.rollout.prompts_per_step = 3
    with pytest.raises(ConfigError, match="rollout.prompts_per_step=3 must be a multiple of the number of processes"):
        check_distributed(plain, DistInfo("ddp", 0, 2, 0, "cpu"))
    check_distributed(plain, DistInfo("none", 0, 1, 0, "cpu"))  # one process: nothing to refuse
    # rollout ranks: the prompts split over the training ranks and over the rollout ranks, checked on every rank
    from vlmrl.trainer.rollout_ranks import Links

    plain.rollout.prompts_per_step = 4
    links = Links(None, None, [1, 2, 3], 1)  # 1 training rank, 3 rollout ranks
    for info in (DistInfo("ddp", 0, 1, 0, "cpu", links=links), DistInfo("none", 0, 3, 0, "cpu", links=links,
                                                                       role="rollout")):
        with pytest.raises(ConfigError, match=r"multiple of the number of rollout ranks \(3\)"):
            check_distributed(plain, info)


def test_unexpected_exceptions_keep_their_traceback(monkeypatch):
    """Only vlmrl's own errors become one line; a bug anywhere else is not disguised as a user error."""
    import vlmrl.trainer.run as run

    def broken(*args, **kwargs):
        raise ValueError("a bug, not a user error")

    monkeypatch.setattr(run, "train", broken)
    with pytest.raises(ValueError, match="a bug"):
        main(["train", "trainer.steps=1"])
