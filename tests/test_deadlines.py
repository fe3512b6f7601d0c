"""vlmrl.deadlines is what the code waits: each wait it lists takes its deadline from there, and the training ranks'
collectives outlast every wait one rank makes alone (docs/scaling.md, "Deadlines")."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from vlmrl import deadlines
from vlmrl.config import load_config
from vlmrl.deadlines import collective_timeout

from .test_train_e2e import GRPO, SMALL

ROOT = Path(__file__).resolve().parents[1]


class Stop(Exception):
    """Ends a run once the waits under test are set up."""


def stop(*args, **kwargs):
    raise Stop()


def test_the_defaults_of_the_config_and_the_engine_are_the_tables():
    from vlmrl.rollout.vllm_engine import DEFAULTS
    from vlmrl.trainer import asynchronous, peers, rollout_ranks

    assert load_config(GRPO).rollout.producer_timeout == deadlines.PRODUCER_TIMEOUT_S == 600
    assert DEFAULTS["timeout"] == deadlines.ENGINE_CALL_S == 1800
    assert rollout_ranks.ROLLOUT_RANK_IDLE == deadlines.ROLLOUT_RANK_IDLE == datetime.timedelta(days=7)
    assert (peers.PEER_WORD_S, peers.STORE_CONNECT_S) == (deadlines.PEER_WORD_S, deadlines.STORE_CONNECT_S)
    assert asynchronous.THREAD_EXIT_S == deadlines.THREAD_EXIT_S


@pytest.mark.parametrize("overrides, hours", [
    ([], 1.0),  # the floor: rank 0 writing a large checkpoint while the others wait at a barrier
    (["rollout.asynchronous=true"], 1.0),  # 2 x 600 s + 600 s is under the floor
    (["rollout.asynchronous=true", "rollout.producer_timeout=3000", "rollout.max_staleness=2"], (3 * 3000 + 600) / 3600),
    (["rollout.engine=vllm", "rollout.vllm={timeout: 7200}"], (7200 + 600) / 3600),
])
def test_the_training_ranks_collectives_outlast_every_wait_a_rank_makes_alone(overrides, hours):
    r = load_config(GRPO, overrides).rollout
    timeout = collective_timeout(r)
    assert timeout == datetime.timedelta(hours=hours)
    # longer than torch's own defaults (gloo 30 minutes, NCCL 10), which a barrier outlived while rank 0 saved alone
    assert timeout > datetime.timedelta(minutes=30)
    # a rank's own deadline expires first, with room for the rest of its step, so its error names what it waited for
    own = [(r.max_staleness + 1) * r.producer_timeout if r.asynchronous else 0.0,
           r.vllm.get("timeout", deadlines.ENGINE_CALL_S) if r.engine == "vllm" else 0.0]
    assert timeout.total_seconds() >= max(own) + deadlines.COLLECTIVE_SLACK_S


def capture_groups(monkeypatch, rank: int, world: int) -> list:
    """torch.distributed replaced by a recorder of every process group made: (ranks or "default", backend, timeout)."""
    made: list = []
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "get_rank", lambda: rank)
    monkeypatch.setattr(dist, "get_world_size", lambda: world)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: made.append(("default", backend, kw.get("timeout"))))
    monkeypatch.setattr(dist, "new_group", lambda ranks=None, **kw: made.append(
        (tuple(ranks) if ranks is not None else "all", kw.get("backend"), kw.get("timeout"))) or len(made))
    return made


def test_every_process_group_of_a_run_has_the_deadline_of_what_it_waits_for(monkeypatch, tmp_path):
    """Through `train`: the training ranks' group, every group of a split run (training, rollout, weights) waits
    `collective_timeout`, the control group ROLLOUT_RANK_IDLE; none is left at torch's default for its backend."""
    from vlmrl.trainer.run import train

    base = [*SMALL, f"trainer.output_dir={tmp_path / 'run'}", "trainer.distributed=ddp", "rollout.asynchronous=true",
            "rollout.producer_timeout=3000", "rollout.prompts_per_step=4", "rollout.group_size=2"]
    cfg = load_config(GRPO, base)
    long = collective_timeout(cfg.rollout)
    assert long == datetime.timedelta(seconds=2 * 3000 + 600)  # not the floor: the value comes from this config

    monkeypatch.setattr("vlmrl.trainer.run.check_distributed", stop)  # (right after the groups are made)
    made = capture_groups(monkeypatch, rank=0, world=2)
    with pytest.raises(Stop):
        train(cfg)
    assert made == [("default", "gloo", long)]

    made = capture_groups(monkeypatch, rank=2, world=3)  # global rank 2 of 2 training + 1 rollout rank
    with pytest.raises(Stop):
        train(load_config(GRPO, [*base, "rollout.rollout_ranks=1"]))
    assert made == [("default", "gloo", long), ((0, 1), None, long), ((2,), None, long),
                    ("all", "gloo", deadlines.ROLLOUT_RANK_IDLE), ((0, 2), None, long)]


SHORT_DEFAULT = """import datetime, runpy, sys
import torch.distributed.distributed_c10d as c10d
c10d._get_default_timeout = lambda backend: datetime.timedelta(seconds=8)  # torch's own default, cut from 30 minutes
sys.argv = ["vlmrl", *sys.argv[1:]]
runpy.run_module("vlmrl", run_name="__main__")
"""

SLOW_ONCE = """import os, time
slept = False
def score(completions, **columns):  # rank 1's first scoring (the start's evaluation) takes 20 s
    global slept
    if os.environ["RANK"] == "1" and not slept:
        slept = True
        time.sleep(20)
    return [1.0 for c in completions]
"""


@pytest.mark.slow  # ~60 s
def test_a_rank_waits_at_a_collective_while_its_peer_works_longer_than_torchs_default(tmp_path):
    """Rank 1 spends 20 s alone (a slow reward) while rank 0 waits at the next collective. With torch's default group
    timeout (30 minutes on gloo, 10 on NCCL; cut to 8 s here) rank 0 timed out and the run failed; the groups now
    wait `collective_timeout` (an hour), and the run finishes."""
    (tmp_path / "launcher.py").write_text(SHORT_DEFAULT)
    (tmp_path / "slow.py").write_text(SLOW_ONCE)
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(tmp_path / "launcher.py"),
            "train", GRPO, *SMALL, "trainer.steps=2", "sft.steps=2", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "data.eval.n=4", "trainer.eval_every=0", f"trainer.output_dir={tmp_path / 'run'}",
            "trainer.distributed=ddp", f"rewards=[{{name: '{tmp_path / 'slow.py'}:score', isolate: false}}]"]
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=400, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoint-2").exists()
