"""The quickstart recipe with a judge reward trains to the end against a local judge server; a reward that keeps
failing is named in a warning."""

from __future__ import annotations

import json
from pathlib import Path

from tests.judge_server import JudgeServer
from tests.test_train_e2e import SMALL
from vlmrl.config import RewardConfig, load_config
from vlmrl.rewards.judge_reward import _CLIENTS
from vlmrl.trainer.run import train

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart_judge.yaml"


def unreachable(completions, **_):
    raise ConnectionError("the metrics service is down")


def test_quickstart_judge_recipe_trains_to_the_end(tmp_path):
    cfg = load_config(RECIPE, SMALL + [f"trainer.output_dir={tmp_path / 'run'}", "trainer.steps=3"])
    # a diagnostic (weight 0) whose every call fails: training goes on, and says so once
    cfg.rewards.append(RewardConfig("tests.test_judge_train:unreachable", weight=0.0, label="service", isolate=False))
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
    assert client.stats["retries"] == 2 and client.stats["http_failures"] == 0
    assert all(r["reward/judge/failures"] == 0 and r["reward/judge/count"] == 6 for r in steps)
    assert all(0.0 <= r["reward/judge/mean"] <= 1.0 for r in steps)
    warnings = [n for n in summary["notes"] if "failed on" in n]
    assert warnings == ["step 1: reward 'service' failed on 100% of its values (6 of 6; weight 0: training is unaffected); "
                        "see reward/service/* in metrics.jsonl and check it with `vlmrl inspect-reward`"]
    # the images went with the requests, as data URLs
    assert any(p.get("type") == "image_url" for r in server.requests for p in r["messages"][-1]["content"])


def test_a_judge_that_refuses_every_image_stops_the_run_with_one_line(tmp_path, capsys):
    """`vlmrl train` with the judge's base_url overridden on the command line (a list item) at a text-only server:
    the third identical refusal ends the run with one `error:` line naming the fix, not a failure per sample."""
    from vlmrl.cli import main

    with JudgeServer(rules={"": "400image"}) as server:
        code = main(["train", str(RECIPE), *SMALL, f"trainer.output_dir={tmp_path / 'run'}", "trainer.steps=2",
                     f"rewards.1.kwargs.base_url={server.base_url}", "rewards.1.kwargs.cache_dir=null",
                     "rewards.1.kwargs.prediction=completion", "rewards.1.kwargs.concurrency=1"])
        sent = len(server.requests)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "not a multimodal model" in line]
    assert code == 2 and sent == 3 and len(lines) == 1
    # (after whatever the progress bar left on that line)
    assert f"error: judge {server.base_url}/chat/completions: 3 requests in a row were refused" in lines[0]
    assert "set send_images: false" in lines[0]
