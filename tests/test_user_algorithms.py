"""A user's own advantage estimator, policy loss and KL estimator, named in a recipe as "file.py:function": they
train, and one that breaks its contract (docs/algorithms.md) is refused when the run starts, naming the recipe key
and the file."""

import json
import textwrap

import pytest
import torch

from vlmrl.algorithms.advantages import resolve_advantage
from vlmrl.algorithms.choices import check_algorithm
from vlmrl.algorithms.kl import kl_estimate
from vlmrl.algorithms.losses import resolve_policy_loss
from vlmrl.cli import main
from vlmrl.config import load_config
from vlmrl.errors import ConfigError, TrainingError
from vlmrl.references import resolve_reference

from .test_train_e2e import SMALL

USER_FILES = {
    "my_adv.py": '''
        from vlmrl.algorithms.advantages import Advantages, group_stats

        calls = []

        def centred(rewards, group_size, scored, **_):
            """A_i = r_i - mean(group) over the scored answers."""
            calls.append(len(rewards))
            _, mean, _ = group_stats(rewards, group_size, scored)
            return Advantages((rewards.view(-1, group_size) - mean).flatten() * scored)
        ''',
    "my_loss.py": '''
        calls = []

        def plain_pg(logp, advantages, mask, **_):
            """-A * logp per token, returned bare."""
            calls.append(tuple(logp.shape))
            return -(advantages[:, None] if advantages.dim() == 1 else advantages) * logp
        ''',
    "my_kl.py": '''
        calls = []

        def squared(logp, ref_logp, **_):
            calls.append(1)
            return 0.5 * (ref_logp - logp) ** 2
        ''',
    "bad.py": '''
        import torch

        def one_argument(rewards):
            return rewards

        def wrong_shape(rewards, **_):
            return rewards[:1]

        def raises(rewards, **_):
            raise KeyError("values")

        def no_gradient(logp, **_):
            return logp.detach()

        def per_sequence_loss(logp, **_):
            return logp.sum(-1)

        def scalar_kl(logp, ref_logp, **_):
            return (logp - ref_logp).mean()

        def always_four(rewards, **_):
            return torch.zeros(4)
        ''',
}


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    for name, text in USER_FILES.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    monkeypatch.chdir(tmp_path)  # the recipe's "my_adv.py:centred" is relative to the working directory
    return tmp_path


def test_a_recipe_with_a_user_estimator_loss_and_kl_trains_two_steps(user_dir, capsys):
    (user_dir / "recipe.yaml").write_text(textwrap.dedent("""
        algorithm:
          advantage: my_adv.py:centred
          policy_loss: my_loss.py:plain_pg
          kl_estimator: my_kl.py:squared
          beta: 0.01
        """))
    assert main(["train", "recipe.yaml", *SMALL, f"trainer.output_dir={user_dir / 'run'}", "trainer.steps=2",
                 "sft.steps=0", "trainer.tensorboard=false"]) == 0
    rows = [json.loads(x) for x in (user_dir / "run/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["phase"] == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert torch.isfinite(torch.tensor(r["loss"])) and "kl" in r
    # the user's functions ran: once on the made-up batch at load, then on every step's batch (N = 2 prompts x 3)
    calls = {name: resolve_reference(f"{name}", "function", {}).__globals__["calls"]
             for name in ("my_adv.py:centred", "my_loss.py:plain_pg", "my_kl.py:squared")}
    assert calls["my_adv.py:centred"] == [4, 6, 6]
    assert calls["my_loss.py:plain_pg"][0] == (2, 3) and len(calls["my_loss.py:plain_pg"]) >= 3
    assert len(calls["my_kl.py:squared"]) >= 3
    assert (user_dir / "run/config.yaml").read_text().count("my_adv.py:centred") == 1


def test_a_wrong_signature_is_refused_before_a_run_directory_exists(user_dir, capsys):
    args = ["train", *SMALL, f"trainer.output_dir={user_dir / 'run'}", "trainer.steps=1", "sft.steps=0",
            "algorithm.advantage=bad.py:one_argument"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "algorithm.advantage='bad.py:one_argument': one_argument(rewards) in " in err
    assert str(user_dir / "bad.py") in err and "an advantage estimator is called with the keyword arguments " \
        "rewards, group_size, scale, mask, kl, beta" in err and "**_" in err and "docs/algorithms.md" in err
    assert not (user_dir / "run").exists()


@pytest.mark.parametrize(("key", "ref", "words"), [
    ("advantage", "bad.py:wrong_shape", "returned advantages of shape (1,) (torch.float32) for N=4 rows of T=3"),
    ("advantage", "bad.py:raises", "raised KeyError: 'values' on a made-up batch"),
    ("advantage", "bad.py:nothing_here", "'bad.py' has no callable 'nothing_here'"),
    ("advantage", "missing.py:fn", "file 'missing.py' not found"),
    ("policy_loss", "bad.py:no_gradient", "no gradient through logp"),
    ("policy_loss", "bad.py:per_sequence_loss", "per-token loss of shape (2,) for logp of shape (2, 3)"),
    ("policy_loss", "my_adv.py:centred", "cannot be called the way a policy loss is"),
    ("kl_estimator", "bad.py:scalar_kl", "returned shape () for log-probs of shape (2, 3)"),
])
def test_a_function_that_breaks_its_contract_is_refused_at_load(user_dir, key, ref, words):
    cfg = load_config(None, [f"algorithm.{key}={ref}"])
    with pytest.raises((ConfigError, FileNotFoundError)) as err:
        check_algorithm(cfg.algorithm)
    assert f"algorithm.{key}" in str(err.value) and words in str(err.value), str(err.value)


def test_an_answer_of_the_wrong_shape_at_a_step_stops_with_the_key(user_dir):
    estimator = resolve_advantage("bad.py:always_four")  # right on the made-up batch of 4
    with pytest.raises(TrainingError, match=r"algorithm.advantage='bad.py:always_four' returned advantages of shape "
                                            r"\(4,\) .* for N=6 rows"):
        estimator(rewards=torch.zeros(6), group_size=3, mask=torch.ones(6, 2), scored=torch.ones(6, dtype=bool))


def test_names_and_rules_stay_as_they_were(user_dir):
    assert resolve_policy_loss("ppo_clip").__name__ == "ppo_clip_loss"
    with pytest.raises(ConfigError, match="expected one of 'grpo', 'rloo', 'reinforce_pp', 'remax', 'gae' or "
                                          "'path/to/file.py:function'"):
        load_config(None, ["algorithm.advantage=grpox"])
    with pytest.raises(ConfigError, match="set algorithm.kl_estimator=k1"):  # the rule on the built-in names holds
        load_config(None, ["algorithm.beta=0.1", "algorithm.kl_in=reward", "algorithm.kl_estimator=k3"])
    cfg = load_config(None, ["algorithm.beta=0.1", "algorithm.kl_in=reward", "algorithm.kl_estimator=my_kl.py:squared"])
    check_algorithm(cfg.algorithm)  # a user's estimator is its author's call, not refused by a rule about k3
    logp, ref = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]]))
    assert kl_estimate(logp, ref, "my_kl.py:squared").item() == pytest.approx(kl_estimate(logp, ref, "k2").item())
