"""Outcome reward models (issue 55 item 1): the Bradley-Terry loss, pairs from a run's rollouts, `vlmrl rm train` on a
separable preference set, the `reward_model` reward in a `vlmrl train` run, and its refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.conftest import TEST_MODEL
from vlmrl.algorithms.losses import bradley_terry_loss
from vlmrl.data import make_task, vocabulary_texts
from vlmrl.errors import ConfigError, DataError
from vlmrl.models import build_tiny_vlm, load_policy
from vlmrl.models.reward_model import REWARD_MODEL_FILE, RewardModel
from vlmrl.rewards import RewardSpec, compute_rewards
from vlmrl.rewards.reward_model import bind_reward_models
from vlmrl.trainer.rm import load_pairs, load_rm_config, train_reward_model
from vlmrl.trainer.rm_pairs import pairs_from_rollouts, split_by_prompt


def test_bradley_terry_loss_and_gradient_by_hand():
    # pair 1: r_c = r_r = 1 -> margin 0, P = 1/2, L = ln 2, dL/dr_c = -(1 - 1/2) = -1/2, dL/dr_r = +1/2
    # pair 2: r_c = ln 3, r_r = 0 -> P = sigmoid(ln 3) = 3/4, L = ln(4/3), dL/dr_c = -(1 - 3/4) = -1/4, dL/dr_r = +1/4
    chosen = torch.tensor([1.0, math.log(3)], requires_grad=True)
    rejected = torch.tensor([1.0, 0.0], requires_grad=True)
    loss, margin = bradley_terry_loss(chosen, rejected)
    assert loss.tolist() == pytest.approx([math.log(2), math.log(4 / 3)], abs=1e-6)
    assert margin.tolist() == pytest.approx([0.0, math.log(3)], abs=1e-6) and not margin.requires_grad
    loss.mean().backward()  # the mean over two pairs halves each gradient
    assert chosen.grad.tolist() == pytest.approx([-0.25, -0.125], abs=1e-6)
    assert rejected.grad.tolist() == pytest.approx([0.25, 0.125], abs=1e-6)


def _write_rollouts(run, entries):
    (run / "gallery").mkdir(parents=True)
    Image.new("RGB", (56, 56), "red").save(run / "gallery" / "step1-a.png")
    (run / "rollouts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))


def test_pairs_from_a_tiny_rollouts_file(tmp_path):
    run = tmp_path / "run"
    _write_rollouts(run, [
        # distinct answers: right {r1}, wrong {w1, w2} (r1 appears twice) -> 1 x 2 = 2 pairs
        {"step": 1, "id": "a", "problem": "How many?", "solution": "3", "image": "gallery/step1-a.png",
         "answers": ["r1", "w1", "r1", "w2"], "correct": [True, False, True, False]},
        {"step": 1, "id": "b", "problem": "q", "solution": "1", "answers": ["x", "y"], "correct": [True, True]},
        {"step": 2, "id": "c", "problem": "q", "solution": "1", "answers": ["x", "y"], "correct": [False, False]},
        # 2 right x 2 wrong = 4 pairs, capped at 3 below
        {"step": 2, "id": "d", "problem": "p", "solution": "2", "answers": ["r1", "r2", "w1", "w2"],
         "correct": [True, True, False, False]},
        {"step": 3, "id": "e", "problem": "p", "answers": ["r1"]},  # no verdicts
    ])
    pairs, report = pairs_from_rollouts(run, max_pairs_per_prompt=3, seed=0)
    assert (report.entries, report.with_pairs, report.all_right, report.all_wrong, report.no_verdicts) == \
        (5, 2, 1, 1, 1)
    a = [p for p in pairs if p["group"] == "a"]
    assert sorted((p["chosen"], p["rejected"]) for p in a) == [("r1", "w1"), ("r1", "w2")]
    assert a[0]["problem"] == "How many?" and a[0]["images"][0].size == (56, 56)
    d = [p for p in pairs if p["group"] == "d"]
    assert len(d) == 3 and all(p["chosen"] in ("r1", "r2") and p["rejected"] in ("w1", "w2") for p in d)
    assert len({(p["chosen"], p["rejected"]) for p in d}) == 3 and not d[0]["images"]
    assert len(pairs_from_rollouts(run, max_pairs_per_prompt=0)[0]) == 2 + 4  # 0 = every pair
    train, held = split_by_prompt(pairs, 0.5, seed=0)  # two prompts: one each side, never split within a prompt
    assert {p["group"] for p in train} ^ {p["group"] for p in held} == {"a", "d"}
    (run / "config.yaml").write_text("data:\n  prompt_template: '{problem} Answer in tags.'\n")
    pairs, template, notes = load_pairs(load_rm_config(None, [f"data.rollouts={run}", "data.max_pairs_per_prompt=3"]))
    assert len(pairs) == 5 and template == "{problem} Answer in tags."  # the run's own template
    assert "5 logged prompts, 2 with a right and a wrong answer" in notes[0]


def _separable_pairs(tmp_path, n=48):
    """Pairs whose preferred answer is visible in the text: the labelled count inside answer tags, over the bare
    number (the format a strict reward pays for)."""
    rows = []
    (tmp_path / "images").mkdir()
    for i, s in enumerate(make_task("shapes_count", n, "train", seed=0)):
        s["images"][0].save(tmp_path / "images" / f"{i}.png")
        rows.append({"image": f"images/{i}.png", "prompt": s["problem"],
                     "chosen": f"<answer>{s['solution']}</answer>", "rejected": f"{s['solution']}"})
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train_small_rm(tmp: Path, source: str, model_dir, steps: int, max_answer_tokens: int, *extra: str) -> dict:
    """`vlmrl rm train` on `source` (data.pairs... or data.steps...) from the test model: a quarter of the prompts
    held out, batches of 8, lr 1e-3, one thread."""
    cfg = load_rm_config(None, [source, "data.heldout=0.25", f"data.max_answer_tokens={max_answer_tokens}",
                                f"model.name_or_path={model_dir}", f"trainer.steps={steps}", "trainer.batch_size=8",
                                "trainer.lr=1e-3", "trainer.eval_every=0", "trainer.threads=1",
                                "trainer.tensorboard=false", f"trainer.output_dir={tmp / 'run'}", *extra])
    return train_reward_model(cfg)


def test_a_frozen_rm_trains_its_head_and_logprob_weight_only(tiny_model_dir, tmp_path):
    """model.freeze=true with model.logprob_term=true: after training, every VLM weight is the start's, the head and
    the term's weight moved, and the saved folder scores with them."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    out = train_small_rm(tmp_path, f"data.pairs.path={_separable_pairs(tmp_path)}", tiny_model_dir, 5, 16,
                         "model.freeze=true", "model.logprob_term=true", "trainer.lr=1e-1")
    start = AutoModelForImageTextToText.from_pretrained(tiny_model_dir).state_dict()
    trained = AutoModelForImageTextToText.from_pretrained(out["checkpoint"]).state_dict()
    assert all(torch.equal(start[k], trained[k]) for k in start)
    head = load_file(Path(out["checkpoint"]) / "reward_head.safetensors")
    assert head["weight"].abs().sum() > 0 and head["logprob_weight"].item() != 1.0
    assert RewardModel.from_pretrained(out["checkpoint"]).logprob_weight.item() == head["logprob_weight"].item()


def test_a_lora_rm_trains_adapters_and_saves_them_merged(tiny_model_dir, tmp_path, monkeypatch):
    """model.lora.r=4: only the adapters and the head train; the saved RM is a plain model folder (adapters merged)
    that scores the held-out pairs exactly as the trained RM did (its mean margin); and it learns the preference."""
    import vlmrl.trainer.rm as rm_module
    from vlmrl.trainer.rm import evaluate_pairs

    trainable = {}
    adamw = rm_module.adamw

    def spy(params, *args):
        params = list(params)
        trainable["n"] = sum(p.numel() for p in params)
        return adamw(params, *args)

    monkeypatch.setattr(rm_module, "adamw", spy)
    pairs_file = _separable_pairs(tmp_path)
    out = train_small_rm(tmp_path, f"data.pairs.path={pairs_file}", tiny_model_dir, 30, 16, "model.lora.r=4")
    start = load_policy(tiny_model_dir)
    total = sum(p.numel() for p in start.model.parameters())
    hidden = start.model.config.text_config.hidden_size
    assert hidden + 1 < trainable["n"] < total / 5  # the head and the adapters, not the VLM
    checkpoint = Path(out["checkpoint"])
    assert not (checkpoint / "adapter_config.json").exists()
    rm = RewardModel.from_pretrained(checkpoint)
    assert not rm.policy.has_adapters
    cfg = load_rm_config(None, [f"data.pairs.path={pairs_file}", "data.heldout=0.25"])
    held = split_by_prompt(load_pairs(cfg)[0], 0.25, 0)[1]
    again = evaluate_pairs(rm, held, 8)
    assert again["margin"] == pytest.approx(out["final"]["margin"], abs=1e-4)
    assert out["final"]["pairwise_accuracy"] >= 0.9, out["final"]


def test_lora_and_a_frozen_vlm_are_refused_together():
    with pytest.raises(ConfigError, match="choose one"):
        load_rm_config(None, ["data.pairs.path=x.jsonl", "model.freeze=true", "model.lora.r=4"])


@pytest.fixture(scope="module")
def trained_rm(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("rm")
    return train_small_rm(tmp, f"data.pairs.path={_separable_pairs(tmp)}", tiny_model_dir, 30, 16)


def test_rm_learns_a_visible_preference_and_saves_a_loadable_folder(trained_rm):
    final = trained_rm["final"]
    assert trained_rm["heldout_pairs"] == 12 and final["prompts"] == 12
    assert final["pairwise_accuracy"] >= 0.9 and final["ci_low"] > 0.5, final
    folder = trained_rm["checkpoint"]
    info = json.loads((Path(folder) / REWARD_MODEL_FILE).read_text())
    assert info["kind"] == "outcome" and info["max_answer_tokens"] == 16
    assert info["trained"]["heldout"]["pairwise_accuracy"] == final["pairwise_accuracy"]
    from transformers import AutoModelForImageTextToText

    AutoModelForImageTextToText.from_pretrained(folder)  # the backbone is a plain model folder
    rm = RewardModel.from_pretrained(folder)
    s = make_task("shapes_count", 1, "test", seed=5)[0]
    out = compute_rewards([RewardSpec("reward_model", kwargs={"path": trained_rm["run_dir"]})],
                          [f"<answer>{s['solution']}</answer>", s["solution"]],
                          {k: [s[k]] * 2 for k in ("id", "problem", "solution", "images")})
    chosen, rejected = out.components["reward_model"]
    assert chosen > rejected and out.failures["reward_model"] == 0
    assert rm.info["vocabulary"] == info["vocabulary"]


def test_reward_model_refuses_a_sample_it_cannot_score(trained_rm):
    s = make_task("shapes_count", 1, "test", seed=5)[0]
    long_answer = "<answer>" + " ".join(["3"] * 40) + "</answer>"
    out = compute_rewards([RewardSpec("reward_model", kwargs={"path": trained_rm["run_dir"]})],
                          [f"<answer>{s['solution']}</answer>", long_answer],
                          {k: [s[k]] * 2 for k in ("id", "problem", "solution", "images")})
    values = out.components["reward_model"]
    assert values[0] is not None and values[1] is None
    assert out.failures["reward_model"] == 1 and out.failed.tolist() == [False, True]
    assert "scores at most 16" in out.errors["reward_model"]
    assert out.extra["reward_model"]["too_long"] == 1.0


def test_reward_model_refuses_a_prompt_past_its_limit(trained_rm, tmp_path):
    import shutil

    folder = tmp_path / "rm"
    shutil.copytree(trained_rm["checkpoint"], folder)
    info = json.loads((folder / REWARD_MODEL_FILE).read_text())
    (folder / REWARD_MODEL_FILE).write_text(json.dumps({**info, "max_prompt_length": 8}))
    s = make_task("shapes_count", 1, "test", seed=5)[0]
    out = compute_rewards([RewardSpec("reward_model", kwargs={"path": str(folder)})], ["<answer>1</answer>"],
                          {k: [s[k]] for k in ("id", "problem", "solution", "images")})
    assert out.components["reward_model"] == [None] and out.failures["reward_model"] == 1
    assert "max_prompt_length (8 tokens)" in out.errors["reward_model"]


@pytest.fixture(scope="module")
def other_vocabulary_dir(tmp_path_factory):
    """The test model with a 300-token vocabulary in place of 400: another tokenizer."""
    return build_tiny_vlm(tmp_path_factory.mktemp("other"), vocabulary_texts(0),
                          type(TEST_MODEL)(**{**vars(TEST_MODEL), "vocab_size": 300}), seed=0)


def test_an_rm_with_another_vocabulary_is_refused(trained_rm, other_vocabulary_dir):
    other = load_policy(other_vocabulary_dir)
    specs = [RewardSpec("reward_model", kwargs={"path": trained_rm["run_dir"]})]
    with pytest.raises(ConfigError, match="tokenizer is not the policy's"):
        bind_reward_models(specs, other)
    relaxed = [RewardSpec("reward_model", kwargs={"path": trained_rm["run_dir"], "same_tokenizer": False})]
    bind_reward_models(relaxed, other)  # scoring the text with the RM's own tokenizer, on request
    assert relaxed[0].kwargs["device"] == "cpu"
    with pytest.raises(ConfigError, match="kwargs.path"):
        bind_reward_models([RewardSpec("reward_model")], other)


def test_rm_train_needs_one_source_of_pairs():
    with pytest.raises(ConfigError, match="exactly one source"):
        load_rm_config(None, [])
    with pytest.raises(ConfigError, match="exactly one source"):
        load_rm_config(None, ["data.pairs.task=shapes_count", "data.rollouts=runs/x"])


def test_the_reward_in_a_two_step_training_run(trained_rm, tiny_model_dir, tmp_path):
    from tests.test_train_e2e import small_config
    from vlmrl.trainer.run import train

    cfg = small_config(tmp_path, "trainer.steps=2", f"model.name_or_path={tiny_model_dir}", "sft.steps=0",
                       f"rewards=[{{name: reward_model, path: {trained_rm['run_dir']}}}, {{name: accuracy, weight: 0}}]")
    assert cfg.rewards[0].kwargs == {"path": trained_rm["run_dir"]}
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["phase"] == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["reward/reward_model/count"] > 0 and r["reward/reward_model/failures"] == 0
        assert math.isfinite(r["reward/reward_model/mean"]) and math.isfinite(r["loss"])


def test_vlmrl_train_refuses_the_rm_before_a_step(trained_rm, other_vocabulary_dir, tmp_path, capsys):
    from tests.test_train_e2e import SMALL
    from vlmrl.cli import main

    run = tmp_path / "run"
    assert main(["train", *SMALL, f"trainer.output_dir={run}", "trainer.steps=1", "sft.steps=0",
                 f"model.name_or_path={other_vocabulary_dir}",
                 f"rewards=[{{name: reward_model, path: {trained_rm['run_dir']}}}]"]) == 2
    assert "tokenizer is not the policy's" in capsys.readouterr().err
    assert not run.exists()  # refused before a training step: the run directory is removed


def test_vlmrl_eval_refuses_the_rm_before_it_generates(trained_rm, other_vocabulary_dir, capsys):
    from vlmrl.cli import main

    assert main(["eval", str(other_vocabulary_dir), f"rewards=[{{name: reward_model, path: {trained_rm['run_dir']}}}]",
                 "--data", "shapes_count", "--n", "4"]) == 2
    err = capsys.readouterr().err
    assert "tokenizer is not the policy's" in err and "eval T=" not in err


def test_a_score_does_not_depend_on_the_answers_batched_with_it(trained_rm):
    """The head reads each row's own last real token: padding after a short answer (beside a long one) and the
    other rows change nothing."""
    s = make_task("shapes_count", 1, "test", seed=5)[0]
    spec = [RewardSpec("reward_model", kwargs={"path": trained_rm["run_dir"]})]
    columns = {k: [s[k]] for k in ("id", "problem", "solution", "images")}
    alone = compute_rewards(spec, ["4"], columns).components["reward_model"][0]
    both = compute_rewards(spec, ["4", "<answer>4</answer>"],
                           {k: v * 2 for k, v in columns.items()}).components["reward_model"]
    assert both[1] is not None and both[0] == pytest.approx(alone, abs=1e-5)


def test_a_prompt_goes_through_the_model_once_for_all_of_its_answers(trained_rm, monkeypatch):
    """Two prompts x 4 answers: the RM embeds 2 prompts (their images through the vision tower once each), and each
    answer's score is the one it gets scored alone."""
    from vlmrl.rewards.reward_model import get_reward_model

    family = get_reward_model(trained_rm["run_dir"], "cpu").policy.family
    seen, embed = [], family.prompt_embeds
    monkeypatch.setattr(family, "prompt_embeds", lambda prompt: seen.append(prompt.input_ids.shape[0]) or embed(prompt))
    samples = make_task("shapes_count", 2, "test", seed=5)
    columns = {k: [s[k] for s in samples for _ in range(4)] for k in ("id", "problem", "solution", "images")}
    answers = [f"<answer>{k}</answer>" for k in range(8)]
    spec = [RewardSpec("reward_model", kwargs={"path": trained_rm["run_dir"]})]
    together = compute_rewards(spec, answers, columns).components["reward_model"]
    assert seen == [2]
    alone = [compute_rewards(spec, [a], {k: [v[i]] for k, v in columns.items()}).components["reward_model"][0]
             for i, a in enumerate(answers)]
    assert together == pytest.approx(alone, abs=1e-5) and len(set(together)) > 2


def test_ensemble_disagreement_penalty_by_hand(trained_rm, tmp_path):
    """Two members: the trained RM, and a copy whose head's bias is 1.0 higher, so every answer's scores are s and
    s + 1: mean s + 0.5, standard deviation 0.5; with disagreement_coef 2: s - 0.5; ensemble min: s."""
    import shutil

    from safetensors.torch import load_file, save_file

    shifted = tmp_path / "shifted"
    shutil.copytree(trained_rm["checkpoint"], shifted)
    head = load_file(shifted / "reward_head.safetensors")
    head["bias"] = head["bias"] + 1.0
    save_file(head, shifted / "reward_head.safetensors")
    s = make_task("shapes_count", 1, "test", seed=5)[0]
    answers = [f"<answer>{s['solution']}</answer>", "7"]
    columns = {k: [s[k]] * 2 for k in ("id", "problem", "solution", "images")}

    def scores(**kwargs):
        out = compute_rewards([RewardSpec("reward_model", kwargs=kwargs)], answers, columns)
        return out.components["reward_model"], out.extra["reward_model"]

    one, _ = scores(path=trained_rm["checkpoint"])
    mean, metrics = scores(path=[trained_rm["checkpoint"], str(shifted)], disagreement_coef=2.0)
    assert mean == pytest.approx([v - 0.5 for v in one], abs=1e-5)
    assert metrics["disagreement"] == pytest.approx(0.5, abs=1e-5)
    worst, _ = scores(path=[trained_rm["checkpoint"], str(shifted)], ensemble="min")
    assert worst == pytest.approx(one, abs=1e-5)


def test_a_run_logs_several_prompts_per_step_for_an_rm(tmp_path):
    """trainer.log_rollouts_prompts: each logged step writes that many prompts (each with its G answers and
    verdicts), which `vlmrl rm train data.rollouts` reads as more pairs."""
    from tests.test_train_e2e import small_config
    from vlmrl.trainer.run import train

    train(small_config(tmp_path, "trainer.steps=2", "trainer.log_rollouts_every=1", "trainer.log_rollouts_prompts=2",
                       "algorithm.dynamic_sampling=false"))
    entries = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert [e["step"] for e in entries] == [1, 1, 2, 2]
    assert entries[0]["id"] != entries[1]["id"] and all(len(e["answers"]) == len(e["correct"]) == 3 for e in entries)
    assert all((tmp_path / "run" / e["image"]).is_file() for e in entries)
    _, report = pairs_from_rollouts(tmp_path / "run")
    assert report.entries == 4


def test_preference_kl_by_hand():
    from vlmrl.algorithms.losses import preference_kl

    # teacher p_t = 0.8 (margin ln 4), student margin 0 (p_s = 0.5):
    # KL = 0.8 ln(0.8 / 0.5) + 0.2 ln(0.2 / 0.5) = 0.37601 - 0.18326 = 0.19274; dKL/dm_s = p_s - p_t = -0.3
    student = torch.tensor([0.0, 1.3], requires_grad=True)
    kl = preference_kl(student, torch.tensor([math.log(4), 1.3]))
    assert kl.tolist() == pytest.approx([0.19274, 0.0], abs=1e-5)  # the same preference: 0
    kl.sum().backward()
    assert student.grad.tolist() == pytest.approx([-0.3, 0.0], abs=1e-6)
    # a certain teacher: the Bradley-Terry loss of its ranking; T = 2 halves its margin: p_t = sigmoid(ln 2) = 2/3
    assert preference_kl(torch.tensor([0.7]), torch.tensor([80.0])).item() == pytest.approx(
        bradley_terry_loss(torch.tensor([0.7]), torch.tensor([0.0]))[0].item(), abs=1e-5)
    p = 2 / 3
    assert preference_kl(torch.tensor([0.0]), torch.tensor([math.log(4)]), temperature=2.0).item() == pytest.approx(
        p * math.log(p / 0.5) + (1 - p) * math.log((1 - p) / 0.5), abs=1e-5)


def _flipped_pairs(tmp_path):
    """The separable pairs with chosen and rejected swapped: labels that say the opposite of the teacher."""
    path = _separable_pairs(tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    flipped = tmp_path / "flipped.jsonl"
    flipped.write_text("".join(json.dumps({**r, "chosen": r["rejected"], "rejected": r["chosen"]}) + "\n"
                               for r in rows))
    return flipped


@pytest.mark.parametrize("coef", [1.0, 0.0])
def test_a_distilled_rm_follows_its_teacher_not_the_labels(trained_rm, tiny_model_dir, tmp_path, coef):
    """With distill.coef = 1 the student learns the teacher's preference (tags over bare numbers) from pairs whose
    labels say the opposite; with coef = 0 it learns the labels: the KL term is what teaches."""
    pairs = _flipped_pairs(tmp_path)
    cfg = load_rm_config(None, [f"data.pairs.path={pairs}", "data.heldout=0.25", "data.max_answer_tokens=16",
                                f"model.name_or_path={tiny_model_dir}", "trainer.steps=30", "trainer.batch_size=8",
                                "trainer.lr=1e-3", "trainer.eval_every=0", "trainer.threads=1",
                                "trainer.tensorboard=false", f"trainer.output_dir={tmp_path / 'run'}",
                                f"distill.teacher={trained_rm['run_dir']}", f"distill.coef={coef}"])
    final = train_reward_model(cfg)["final"]
    assert final["teacher_pairwise_accuracy"] <= 0.1  # the teacher disagrees with the flipped labels
    # an untrained head (every margin 0) would "agree" with a teacher that ranks every pair wrong: the margins must
    # have moved, and in the teacher's direction
    if coef == 1.0:
        assert final["teacher_agreement"] >= 0.9 and final["pairwise_accuracy"] <= 0.1, final
        assert final["margin"] <= -1.0, final
    else:
        assert final["teacher_agreement"] <= 0.1 and final["pairwise_accuracy"] >= 0.9, final
        assert final["margin"] >= 1.0, final


def test_a_teacher_of_the_other_kind_is_refused_before_a_run_directory(trained_rm, tmp_path):
    from tests.test_process_reward_model import _visible_step_file

    steps = _visible_step_file(tmp_path)
    cfg = load_rm_config(None, [f"data.steps.path={steps}", f"distill.teacher={trained_rm['run_dir']}",
                                f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(DataError, match="an outcome reward model; training a process RM needs a process teacher"):
        train_reward_model(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # ~1 min: two runs of 2 RL steps, one under torchrun x2
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_the_reward_under_torchrun_matches_one_process(trained_rm, tiny_model_dir, tmp_path, mode):
    """Every rank loads the RM on its own device and scores its own answers; the run ends where one process does."""
    from tests.test_distributed import assert_matches, run

    extra = (f"model.name_or_path={tiny_model_dir}", "sft.steps=0",
             f"rewards=[{{name: reward_model, path: {trained_rm['run_dir']}}}, {{name: accuracy, weight: 0}}]")
    one = run(tmp_path, "single", "none", 1, extra=extra)
    floor = run(tmp_path, "single-mb1", "none", 1, extra=(*extra, "trainer.micro_batch=1"))  # rounding alone
    two = run(tmp_path, mode, mode, 2, extra=extra)
    start = weights_of(tmp_path / "single" / "checkpoint-0")
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-3  # the RM's reward moved the weights
    assert_matches(one, two, floor)
    for name in ("single", mode):
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if r["phase"] == "train"]
        assert len(steps) == 2 and all(r["reward/reward_model/failures"] == 0 for r in steps)
        assert all(r["reward/reward_model/count"] > 0 for r in steps)


@pytest.mark.slow  # ~1 min: one process and torchrun x2, 3 asynchronous RL steps each
def test_the_reward_on_a_rollout_rank_matches_one_process(trained_rm, tiny_model_dir, tmp_path):
    """rollout.rollout_ranks=1: the RM scores every training answer on the rollout rank (where they are sampled),
    beside the generator, not on the training rank; the run ends exactly where one process with asynchronous
    rollouts does, and the rollout rank's scores are the ones logged."""
    from tests.test_distributed import run

    extra = (f"model.name_or_path={tiny_model_dir}", "sft.steps=0", "rollout.asynchronous=true",
             "rollout.max_staleness=1", "trainer.steps=3",
             f"rewards=[{{name: reward_model, path: {trained_rm['run_dir']}}}, {{name: accuracy, weight: 0}}]")
    one = run(tmp_path, "single", "none", 1, extra=extra, checkpoint="checkpoint-3")
    said: list[str] = []
    two = run(tmp_path, "split", "ddp", 2, extra=(*extra, "rollout.rollout_ranks=1"), stdout=said,
              checkpoint="checkpoint-3")
    assert "rollout rank 0: produced" in said[0]
    for k in one:
        assert torch.equal(one[k], two[k]), k
    logged = {name: [r for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
                     if r["phase"] == "train"] for name in ("single", "split")}
    assert len(logged["split"]) == 3 and all(r["reward/reward_model/count"] > 0 for r in logged["split"])
    assert [r["reward/reward_model/mean"] for r in logged["split"]] == \
        [r["reward/reward_model/mean"] for r in logged["single"]]


def weights_of(checkpoint: Path) -> dict:
    from tests.test_distributed import weights

    return weights(checkpoint)
