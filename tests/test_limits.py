"""Before any training step: labelled answers fit the generation budget, prompts fit max_prompt_length, the tiny
tokenizer knows the user's words; during training: a run with no learning signal says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlmrl.config import ConfigError, load_config
from vlmrl.models import PromptTooLongError
from vlmrl.rewards import RewardSpec
from vlmrl.trainer.limits import check_label_lengths, check_prompt_lengths, user_texts
from vlmrl.trainer.watch import (
    OverOptimisationWatch,
    RewardFailureWatch,
    SignalWatch,
    SparseSignalWatch,
    task_graders,
    truncation_warning,
)


def test_a_label_that_cannot_be_generated_whole_is_refused(policy, count_samples):
    cfg = load_config(None, ["rollout.max_new_tokens=12"])
    need = check_label_lengths(policy, cfg, count_samples)
    assert 2 <= need <= 12
    long = {**count_samples[0], "id": "long-one", "solution": "a rather long multi word answer phrase"}
    tokens = len(policy.processor.tokenizer(f"<answer>{long['solution']}</answer>",
                                            add_special_tokens=False)["input_ids"]) + 1
    with pytest.raises(ConfigError) as e:
        check_label_lengths(policy, cfg, count_samples, [long])
    msg = str(e.value)
    assert msg.startswith("rollout.max_new_tokens=12 is too short for the labelled answers: 1 of 13 do not fit")
    assert "'long-one'" in msg and f"takes {tokens} tokens" in msg and f"set rollout.max_new_tokens={tokens}" in msg
    fits = load_config(None, [f"rollout.max_new_tokens={tokens}"])
    with pytest.raises(ConfigError, match=f"eval.max_new_tokens=12 is too short.*set eval.max_new_tokens={tokens}"):
        check_label_lengths(policy, fits, [long])
    both = load_config(None, [f"rollout.max_new_tokens={tokens}", f"eval.max_new_tokens={tokens}"])
    assert check_label_lengths(policy, both, [long]) == tokens


def test_the_advised_budget_keeps_every_label_clear_of_the_length_penalty(policy, count_samples):
    """With a `length` reward that follows rollout.max_new_tokens (the quickstart's), its last third is penalised:
    the check asks for a budget whose penalty starts after the longest label, so following its advice never
    penalises a right answer. By hand: a 15-token label needs 22 (22 - 22 // 3 = 15), not 15 (penalised past 10)."""
    from vlmrl.rewards.specs import length_kwargs
    from vlmrl.trainer.limits import clear_budget

    assert [clear_budget(n) for n in (5, 8, 15)] == [7, 11, 22]
    long = {**count_samples[0], "id": "long-one", "solution": "a rather long multi word answer phrase"}
    tokens = len(policy.processor.tokenizer(f"<answer>{long['solution']}</answer>",
                                            add_special_tokens=False)["input_ids"]) + 1
    shaped = ["rewards=[{name: accuracy}, {name: length}]", f"eval.max_new_tokens={tokens}"]
    with pytest.raises(ConfigError) as e:  # the label fits, but in the penalty
        check_label_lengths(policy, load_config(None, [*shaped, f"rollout.max_new_tokens={tokens}"]), [long])
    advised = int(str(e.value).split("set rollout.max_new_tokens=")[1].split()[0])
    assert advised == clear_budget(tokens) > tokens and "fall in the length penalty" in str(e.value)
    assert check_label_lengths(policy, load_config(None, [*shaped, f"rollout.max_new_tokens={advised}"]),
                               [long]) == tokens
    limits = length_kwargs({}, advised)  # what the length reward then uses
    assert tokens <= limits["max_length"] - limits["cache_length"]
    # a recipe that sets max_length itself is warned about instead (rewards/specs.py: budget_warnings)
    explicit = ["rewards=[{name: accuracy}, {name: length, kwargs: {max_length: 40}}]", f"eval.max_new_tokens={tokens}"]
    assert check_label_lengths(policy, load_config(None, [*explicit, f"rollout.max_new_tokens={tokens}"]),
                               [long]) == tokens


def test_every_prompt_is_checked_at_load(policy, count_samples):
    cfg = load_config(None, [])
    longest = check_prompt_lengths(policy, cfg, count_samples)
    wordy = {**count_samples[5], "id": "wordy", "problem": "count " * 400}
    short = load_config(None, [f"data.max_prompt_length={longest}"])
    assert check_prompt_lengths(policy, short, count_samples) == longest
    with pytest.raises(PromptTooLongError, match=f"sample 'wordy': prompt is .* over data.max_prompt_length={longest}"):
        check_prompt_lengths(policy, short, count_samples[:3], [wordy])


def test_user_text_reaches_the_tiny_tokenizer(count_samples):
    cfg = load_config(None, [])
    user = [{"id": "u.jsonl:1", "task": "u", "images": [], "problem": "Which bird?", "solution": "great crested grebe"}]
    texts = user_texts(cfg, count_samples, user)
    assert texts == ["Which bird?", "<answer>great crested grebe</answer>"]  # built-in text is already in the corpus


def step_metrics(zero_variance=1.0, reward=0.0, truncated=0.9, accuracy=0.0):
    return {"zero_variance_groups": zero_variance, "reward/total/mean": reward, "reward/total/std": 0.0,
            "truncated_share": truncated, "accuracy": accuracy, "reward/failure_rate": 0.0}


def test_a_run_without_learning_signal_says_so_once():
    cfg = load_config(None, ["trainer.no_signal_steps=5"])
    watch = SignalWatch(cfg)
    messages = [watch.update(step, step_metrics()) for step in range(1, 12)]
    assert [i + 1 for i, m in enumerate(messages) if m] == [5]
    text = messages[4]
    assert text.startswith("step 5: no learning signal for 5 steps in a row")
    assert "90% of answers were cut at rollout.max_new_tokens=12" in text and "no answer earned any reward" in text
    metrics = step_metrics(zero_variance=0.5)
    assert watch.update(12, metrics) is None and metrics["no_signal_streak"] == 0.0  # signal resets the streak
    assert [watch.update(s, step_metrics(truncated=0.0, reward=1.0, accuracy=1.0)) for s in range(13, 18)][-1] \
        .endswith("every answer was correct: the task is solved for this policy; use harder data")


def test_no_signal_warning_can_be_turned_off_and_single_answers_use_the_batch_std():
    assert not any(SignalWatch(load_config(None, ["trainer.no_signal_steps=0"])).update(s, step_metrics())
                   for s in range(1, 50))
    cfg = load_config(None, ["rollout.group_size=1", "algorithm.advantage=reinforce_pp", "trainer.no_signal_steps=2"])
    watch = SignalWatch(cfg)
    varied = {"reward/total/std": 0.3, "reward/total/mean": 0.5}
    assert watch.update(1, dict(varied)) is None and watch.update(2, dict(varied)) is None
    assert watch.update(3, {"reward/total/std": 0.0}) is None and watch.update(4, {"reward/total/std": 0.0})


def task_groups(groups: dict[str, tuple[int, int, int, int]], prompts: int = 112) -> dict[str, float]:
    """An RL step's per-task counts: task -> (groups generated, with a signal, solved by every answer, by none)."""
    out = {"dynamic_sampling/prompts": float(prompts)}
    for task, counts in groups.items():
        out |= {f"task/{task}/{key}": float(v) for key, v in
                zip(("groups", "signal_groups", "solved_groups", "unsolved_groups"), counts, strict=True)}
    return out


def test_a_run_whose_groups_mostly_lack_a_signal_names_the_task_once():
    cfg = load_config(None, ["trainer.no_signal_steps=4"])
    specs = [RewardSpec("accuracy"), RewardSpec("length"), RewardSpec("iou", kwargs={"strict": True}),
             RewardSpec("format", weight=0.0)]
    samples = [{"task": "boxes", "answer_type": "box"}, {"task": "words", "answer_type": "text"}, {"problem": "?"}]
    graders = task_graders(specs, samples)  # length is shaping, format weighs 0, iou grades boxes only
    assert graders == {"boxes": ["accuracy", "iou"], "words": ["accuracy"], "data": ["accuracy"]}
    watch = SparseSignalWatch(cfg, graders)
    # the stalled box run: 56 box groups, all silent, none solved; 56 word groups, 51 silent, 45 of them solved
    stalled = task_groups({"boxes": (56, 0, 0, 56), "words": (56, 5, 45, 6)})
    messages = [watch.update(step, dict(stalled)) for step in range(1, 8)]
    assert [i + 1 for i, m in enumerate(messages) if m] == [4]  # after the window, then once
    text = messages[3]
    assert text.startswith("steps 1-4: 96% of the generated groups had no learning signal")
    assert "dynamic sampling generated 112 prompts per step to keep 16" in text
    assert "task 'boxes': 100% of its 224 groups (0 solved by every answer, 224 by none): no answer earns more " \
           "than another under the rewards that grade it (accuracy, iou); give it a graded reward where it has " \
           "none (such as `iou` for boxes) or a better start" in text  # iou is on: the start is what is missing
    assert "task 'words': 91% of its 224 groups (180 solved by every answer, 24 by none): solved; " \
           "curriculum.filter_solved skips such prompts" in text
    assert text.index("'boxes'") < text.index("'words'")  # the most silent task first
    # the quickstart's own share (60-75% without a signal) is quiet; a recovery re-arms the warning
    normal = task_groups({"count": (60, 20, 30, 10)}, prompts=60)
    quiet = SparseSignalWatch(cfg)
    assert not any(quiet.update(step, dict(normal)) for step in range(1, 30))
    assert not any(watch.update(step, dict(normal)) for step in range(8, 12))
    again = [watch.update(step, dict(stalled)) for step in range(12, 16)]
    assert [m is not None for m in again] == [False, True, False, False]  # the window's share passes 85% again
    assert again[1].startswith("steps 10-13: 85% of the generated groups")  # 294 of 344
    assert not any(SparseSignalWatch(load_config(None, ["trainer.no_signal_steps=0"])).update(s, dict(stalled))
                   for s in range(1, 30))


def held_out(accuracy: float, proxy: float, key: str = "reward_model") -> dict:
    return {"greedy/accuracy": accuracy, "greedy/accuracy_ci_low": accuracy - 0.04,
            "greedy/accuracy_ci_high": accuracy + 0.04, f"greedy/reward/{key}": proxy}


def test_a_learned_reward_rising_while_held_out_accuracy_falls_is_said_once():
    rm = "rewards=[{name: reward_model, weight: 1.0, path: rm}, {name: accuracy, weight: 0.0}]"
    watch = OverOptimisationWatch(load_config(None, [rm]))
    # accuracy peaks at step 200 (60%, interval from 56%); the RM's score keeps rising
    said = [watch.update(step, held_out(acc, proxy)) for step, acc, proxy in
            [(100, 0.50, 0.20), (200, 0.60, 0.30), (300, 0.57, 0.40), (400, 0.52, 0.55), (500, 0.40, 0.70)]]
    assert [s is not None for s in said] == [False, False, False, True, False]  # 57% is inside the interval; once
    assert said[3].startswith("step 400: the learned reward 'reward_model' rose 0.300 -> 0.550 on the held-out set "
                              "since step 200, while held-out accuracy fell 60.0% (95% interval from 56.0%) -> 52.0%")
    # accuracy falling while the learned reward falls too is not over-optimisation; nor is a reward nobody weighs
    quiet = OverOptimisationWatch(load_config(None, [rm]))
    assert not any(quiet.update(s, held_out(a, p)) for s, a, p in [(1, 0.6, 0.5), (2, 0.4, 0.3), (3, 0.3, 0.2)])
    for off in ("rewards=[{name: accuracy}, {name: reward_model, weight: 0.0, path: rm}]",  # no weighted RM
                f"{rm.replace('accuracy, weight: 0.0', 'accuracy, weight: 0.0, label: gold')}"):
        w = OverOptimisationWatch(load_config(None, [off, "solved.reward=reward_model"]
                                              if "label: gold" in off else [off]))
        assert not any(w.update(s, held_out(a, p)) for s, a, p in [(1, 0.6, 0.1), (2, 0.3, 0.9)])
    judge = OverOptimisationWatch(load_config(None, ["rewards=[{name: judge, weight: 1.0}]"]))
    assert judge.update(1, held_out(0.6, 0.1, "judge")) is None
    assert "the learned reward 'judge' rose" in judge.update(2, held_out(0.3, 0.9, "judge"))


def test_truncation_warning():
    assert truncation_warning(0.2, "eval.max_new_tokens", 12, "eval") is None
    assert truncation_warning(0.5, "eval.max_new_tokens", 12, "eval T=0.0") == (
        "eval T=0.0: 50% of answers were cut at eval.max_new_tokens=12 (truncated answers usually score 0); raise "
        "eval.max_new_tokens")


def reward_metrics(judge_failed: float, judge_count: float, **judge_counters) -> dict:
    return {"reward/judge/failures": judge_failed, "reward/judge/count": judge_count, "reward/judge/mean": 0.5,
            **{f"reward/judge/{k}": v for k, v in judge_counters.items()},
            # accuracy: 4 values, 4 "does not apply" Nones (not failures), never a failure
            "reward/accuracy/failures": 0.0, "reward/accuracy/count": 4.0, "reward/failure_rate": 0.0}


def test_a_reward_that_keeps_failing_is_named_with_its_counters():
    watch = RewardFailureWatch(load_config(None, []))
    said = {s: watch.update(s, reward_metrics(0, 8, timeouts=0)) for s in range(1, 4)}
    said[4] = watch.update(4, reward_metrics(6, 2, timeouts=6, requests=14))  # 6 / (6 + 26) = 18.75%
    said[5] = watch.update(5, reward_metrics(6, 2, timeouts=6))  # 12 / 40: still over, said once
    assert [s for s, text in said.items() if text] == [4]
    assert said[4] == ("steps 1-4: reward 'judge' failed on 19% of its values (6 of 32; those samples get no loss) "
                       "[requests 14, timeouts 6]; see reward/judge/* in metrics.jsonl and check it with "
                       "`vlmrl inspect-reward`")
    # steps 6-15 score everything; over the last 10 steps: 12/80 = 15% at step 13, 6/80 = 7.5% at 14 (re-armed)
    assert not any(watch.update(s, reward_metrics(0, 8)) for s in range(6, 16))
    assert watch.update(16, reward_metrics(8, 0)) is None  # steps 7-16: 8 / 80 = 10%, not over
    again = watch.update(17, reward_metrics(8, 0))  # steps 8-17: 16 / 80 = 20%
    assert again.startswith("steps 8-17: reward 'judge' failed on 20% of its values (16 of 80;")
    assert RewardFailureWatch(load_config(None, [])).update(1, reward_metrics(1, 9)) is None  # 1 / 10: not over
    first = RewardFailureWatch(load_config(None, [])).update(1, reward_metrics(2, 8))
    assert first.startswith("step 1: reward 'judge' failed on 20% of its values (2 of 10;")


def test_user_words_become_tokens_so_phrase_labels_fit():
    """Multi-word labels the built-in corpus never saw: bytes-level pieces without the user's text, whole words with
    it (the tiny tokenizer is trained on both), so the same labels fit the quickstart's 12 new tokens."""
    from vlmrl.data import vocabulary_texts
    from vlmrl.models.tiny import train_tokenizer

    phrases = ["great crested grebe", "black headed gull", "common kingfisher", "barn swallow", "grey heron"]
    user = [{"id": f"birds.jsonl:{i}", "task": "birds", "images": [], "problem": "Which bird is this?",
             "solution": p} for i, p in enumerate(phrases * 20)]
    labels = [f"<answer>{p}</answer>" for p in phrases]
    builtin = train_tokenizer(vocabulary_texts(0), 512)
    with_user = train_tokenizer(vocabulary_texts(0) + user_texts(load_config(None, []), user), 512)
    before = max(len(builtin(t, add_special_tokens=False)["input_ids"]) + 1 for t in labels)
    after = max(len(with_user(t, add_special_tokens=False)["input_ids"]) + 1 for t in labels)
    assert before > 12 >= after, (before, after)


SMALL_TINY = ["trainer.threads=1", "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
              "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=64", "model.tiny.vision_depth=1",
              "model.tiny.vision_dim=32", "model.tiny.vision_heads=2"]


def test_training_on_labels_longer_than_the_budget_stops_before_any_step(tmp_path, monkeypatch, capsys):
    import json

    from vlmrl.cli import main

    monkeypatch.chdir(tmp_path)
    rows = [{"problem": "Describe the bird.", "solution": "a small brown bird with a long curved beak sitting on "
                                                          "a mossy branch in the rain"}] * 4
    (tmp_path / "birds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = "{path: birds.jsonl}"
    code = main(["train", f"data.train={spec}", f"data.sft={spec}", f"data.eval={spec}", *SMALL_TINY])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # (a library may warn before, e.g. tokenizers about a fork)
    assert code == 2 and last.startswith("error: rollout.max_new_tokens=12 is too short for the labelled answers"), err
    # the refused run said where it would write, and left nothing there (issue 42: no numbered sibling next time)
    assert f"run directory: {Path('runs/quickstart')}" in err and not (tmp_path / "runs" / "quickstart").exists()
    (tmp_path / "runs" / "quickstart").mkdir(parents=True)  # a folder the user made, empty: kept, and still empty
    assert main(["train", f"data.train={spec}", f"data.sft={spec}", f"data.eval={spec}", *SMALL_TINY]) == 2
    assert list((tmp_path / "runs").iterdir()) == [tmp_path / "runs" / "quickstart"]
    assert not any((tmp_path / "runs" / "quickstart").iterdir())
