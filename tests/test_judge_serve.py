"""The judge against a real OpenAI-compatible server: vlmrl's own `vlmrl serve` of a tiny checkpoint. Its replies
carry no verdict (a random tiny model), so every judged answer is a counted failure; a wrong model id or a request
past the server's limits is refused, and the judge stops after the first few identical refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_serve_chat import running
from tests.test_train_e2e import SMALL
from vlmrl.config import load_config
from vlmrl.data import make_task
from vlmrl.models import load_policy
from vlmrl.rewards import REWARDS
from vlmrl.rewards.judge import JudgeClient, JudgeRefusedError
from vlmrl.rewards.registry import RewardFailure
from vlmrl.serve.chat import chat_app, load_chat_model
from vlmrl.serve.guard import ServeLimits
from vlmrl.trainer.checkpoint import save_checkpoint
from vlmrl.trainer.run import train

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart_judge.yaml"


@pytest.fixture(scope="module")
def judge_url(tmp_path_factory, tiny_model_dir):
    """`vlmrl serve` of a tiny checkpoint, as the judge (model id "judge"), 8 tokens per reply at most."""
    run = tmp_path_factory.mktemp("judge_run")
    save_checkpoint(run / "checkpoint-1", load_policy(tiny_model_dir), load_config(None, []), {"step": 1})
    app = chat_app(load_chat_model(run, model_name="judge"), ServeLimits(max_tokens=8, batch_wait_ms=20))
    with running(app) as url:
        yield f"{url}/v1"


def test_every_reply_without_a_verdict_is_a_counted_failure(judge_url):
    samples = make_task("shapes_count", 4, "test", seed=0)
    columns = {"problem": [s["problem"] for s in samples], "solution": [s["solution"] for s in samples]}
    answers = ["3", "4", "two", ""]  # the empty answer is not judged (0.0, not a failure)
    out = REWARDS["judge"](answers, images=[s["images"] for s in samples], base_url=judge_url, model="judge",
                           cache_dir=None, max_tokens=8, prediction="completion", **columns)
    assert out[3] == 0.0
    assert all(isinstance(v, RewardFailure) for v in out[:3]), list(out)
    # three requests went out and each got a reply: none failed over HTTP, none had a verdict
    assert out.metrics["requests"] == 3 and out.metrics["http_failures"] == 0
    assert out.metrics["verdicts"] == 0 and out.metrics["no_verdict"] + out.metrics["cut_at_max_tokens"] == 3
    assert all(d["attempts"] == 1 for d in out.details[:3])


def test_a_wrong_model_id_stops_after_the_refusal_limit(judge_url):
    client = JudgeClient(judge_url, "no-such-model", cache_dir=None, concurrency=1, refusal_limit=3, max_tokens=8)
    results = client.judge_many([client.messages("q", "a", "b"), client.messages("q", "c", "d")])
    assert all(r.failed for r in results) and client.stats["http_failures"] == 2
    with pytest.raises(JudgeRefusedError, match="judge"):  # the third identical 404: every later one would be too
        client.judge_many([client.messages("q", "e", "f")])
    client.close()


def test_quickstart_judge_recipe_against_vlmrl_serve(tmp_path, judge_url):
    """The shipped recipe pointed at `vlmrl serve`: training runs, and every judged answer is a logged failure."""
    cfg = load_config(RECIPE, SMALL + [f"trainer.output_dir={tmp_path / 'run'}", "trainer.steps=2",
                                       f"rewards.1.kwargs.base_url={judge_url}", "rewards.1.kwargs.cache_dir=null",
                                       "rewards.1.kwargs.prediction=completion", "rewards.1.kwargs.max_tokens=8"])
    summary = train(cfg)
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["phase"] == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:  # 2 prompts x 3 answers: each judged one came back without a verdict, the empty ones pay 0
        assert row["reward/judge/failures"] >= 1 and row["reward/judge/failures"] + row["reward/judge/count"] == 6
        assert row["reward/judge/http_failures"] == 0 and row["reward/judge/verdicts"] == 0
        assert row["reward/judge/no_verdict"] + row["reward/judge/cut_at_max_tokens"] == row["reward/judge/requests"]
    assert any("reward 'judge' failed on" in n for n in summary["notes"])
