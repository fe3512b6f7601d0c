"""A recipe's rewards as RewardSpecs: the length penalty's limits follow the generation budget (issue 42, item 3)."""

from pathlib import Path

import pytest

from vlmrl.config import QUICKSTART, load_config
from vlmrl.rewards import RewardSpec, compute_rewards
from vlmrl.rewards.specs import budget_warnings, reward_specs

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.mark.parametrize("recipe", [QUICKSTART, RECIPES / "dapo.yaml"])
def test_shipped_recipes_score_with_the_limits_they_wrote_before(recipe):
    # both recipes wrote {max_length: 12, cache_length: 4} by hand; they now follow max_new_tokens=12 to the same
    specs = reward_specs(load_config(recipe))
    assert specs[:2] == [RewardSpec("accuracy", 1.0, {}),
                         RewardSpec("length", 1.0, {"max_length": 12, "cache_length": 4})]
    # the quickstart also pays a box answer its IoU (None on its numbers)
    assert specs[2:] == ([RewardSpec("iou", 1.0, {"strict": True})] if recipe == QUICKSTART else [])
    assert budget_warnings(load_config(recipe)) == []


def test_raising_max_new_tokens_moves_the_length_penalty_with_it():
    cfg = load_config(QUICKSTART, ["rollout.max_new_tokens=16", "eval.max_new_tokens=16"])
    (length,) = [s for s in reward_specs(cfg) if s.name == "length"]
    assert length.kwargs == {"max_length": 16, "cache_length": 5}
    assert budget_warnings(cfg) == []
    # a 10-token answer fits the budget of 16 and is not penalised (under the old fixed 12/4 it scored -0.5)
    out = compute_rewards([length], ["x"], {"completion_lengths": [10]})
    assert out.components["length"] == [0.0]


def test_a_max_length_set_below_the_budget_is_kept_and_warned_about():
    cfg = load_config(QUICKSTART, ["rollout.max_new_tokens=16", "rewards=[{name: accuracy}, {name: length, kwargs: "
                                   "{max_length: 12, cache_length: 4}}]"])
    assert reward_specs(cfg)[1].kwargs == {"max_length": 12, "cache_length": 4}
    (warning,) = budget_warnings(cfg)
    assert warning.startswith("rewards[1] (length): max_length=12 is below rollout.max_new_tokens=16")
    assert "longer than 8 tokens are penalised" in warning
    # set at or above the budget: no warning; only max_length set: the cache is a third of it
    cfg = load_config(QUICKSTART, ["rewards=[{name: length, kwargs: {max_length: 30}}]"])
    assert budget_warnings(cfg) == [] and reward_specs(cfg)[0].kwargs == {"max_length": 30, "cache_length": 10}


def test_an_agent_budget_is_its_episode_of_policy_tokens():
    cfg = load_config(None, ["agent.tools=[zoom]", "agent.max_turns=2", "agent.turn_tokens=40", "rewards=[{name: length}]"])
    assert reward_specs(cfg)[0].kwargs == {"max_length": 80, "cache_length": 26}
