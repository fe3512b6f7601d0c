"""The quickstart recipe with a judge reward trains to the end against a local judge server."""

from __future__ import annotations

import json
from pathlib import Path

from tests.judge_server import JudgeServer
from tests.test_train_e2e import SMALL
from vlmrl.config import load_config
from vlmrl.rewards.judge_reward import _CLIENTS
from vlmrl.trainer.run import train

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart_judge.yaml"


def test_quickstart_judge_recipe_trains_to_the_end(tmp_path):
    cfg = load_config(RECIPE, SMALL + [f"trainer.output_dir={tmp_path / 'run'}", "trainer.steps=3"])
    judge = next(r for r in cfg.rewards if r.name == "judge")
    assert judge.kwargs["base_url"] == "http://127.0.0.1:8000/v1"
    with JudgeServer(script=["500", "429"], retry_after="0") as server:
        # the tiny model rarely closes an answer block in 6 tokens: grade whole completions so the judge is called
        judge.kwargs.update(base_url=server.base_url, cache_dir=str(tmp_path / "cache"), prediction="completion",
                            backoff_base=0.01)
        summary = train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["phase"] == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3] and summary["final"]
    assert server.requests and all(r["model"] == "judge" for r in server.requests)
    assert sum(r["reward/judge/requests"] for r in steps) >= 1
    # the scripted 500 and 429 were retried (by the held-out evaluation's scoring, which comes first)
    client = next(c for c in _CLIENTS.values() if c.url == server.base_url + "/chat/completions")
    assert client.stats["retries"] == 2 and client.stats["failures"] == 0
    assert all(r["reward/judge/failures"] == 0 and r["reward/judge/count"] == 6 for r in steps)
    assert all(0.0 <= r["reward/judge/mean"] <= 1.0 for r in steps)
    # the images went with the requests, as data URLs
    assert any(p.get("type") == "image_url" for r in server.requests for p in r["messages"][-1]["content"])
