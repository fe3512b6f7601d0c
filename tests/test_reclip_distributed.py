"""ReCLIP under torchrun: two ranks (gloo, CPU), with ddp or with fsdp2's sharded blocks, equal one process within
float rounding, and a run resumed from its checkpoint equals the unbroken one."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.test_reclip_train import TINY

# candidates drawn (rl.selection=sample) and every counterfactual kept: a top-k pick, or the first of a limited number
# of counterfactuals, between candidates whose similarities tie within rounding may go either way (the ranks embed
# in other batch shapes than one process, so similarities differ in the last bits); a draw does not flip
RUN = [*TINY, "data.train.n=32", "warmup.steps=3", "rl.steps=6", "rl.bank_size=16", "rl.bank_refresh=2",
       "rl.counterfactuals=50", "rl.selection=sample", "trainer.eval_every=0"]


def reclip(tmp_path, name, nproc, *extra):
    out = tmp_path / name
    launch = (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "vlmrl"]
              if nproc > 1 else ["-m", "vlmrl"])
    done = subprocess.run([sys.executable, *launch, "reclip", "train", *RUN, f"trainer.output_dir={out}", *extra],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    weights = load_file(next((out / "student").glob("*.safetensors")))
    return rows, weights


def phase(rows, name):
    return [r for r in rows if r["phase"] == name]


KEYS = ("loss", "grad_norm", "t2i/reward_mean", "i2t/reward_mean", "counterfactual/captions", "judge/calls",
        "anchor_infonce")


def assert_same_run(one, w_one, two, w_two, phases=("warmup", "train"), keys=KEYS):
    for name in phases:
        a, b = phase(one, name), phase(two, name)
        assert len(a) == len(b) > 0
        for x, y in zip(a, b, strict=True):
            for key in keys:
                if key in x:
                    assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (name, x["step"], key)
    assert w_one.keys() == w_two.keys()
    for key in w_one:
        if key.endswith("k_proj.bias"):  # its true gradient is 0 (softmax ignores it): Adam scales rounding noise
            continue
        torch.testing.assert_close(w_two[key], w_one[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return reclip(tmp_path_factory.mktemp("one"), "one", 1)


@pytest.mark.slow  # ~60 s each
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_ranks_equal_one_process(tmp_path, single, mode):
    one, w_one = single
    two, w_two = reclip(tmp_path, "two", 2, f"trainer.distributed={mode}")
    assert_same_run(one, w_one, two, w_two)
    assert phase(one, "train")[0]["counterfactual/captions"] > 0
    sharded = phase(two, "summary")[0]["sharded_parameters"]
    assert (sharded > 0) == (mode == "fsdp2")  # the transformer layers' weights were sharded
    held_out = [r for r in phase(one, "eval")][-1], [r for r in phase(two, "eval")][-1]
    assert held_out[1]["t2i/R@1"] == pytest.approx(held_out[0]["t2i/R@1"], abs=1 / 12 + 1e-9)  # at most one of 12


@pytest.mark.slow  # ~90 s each
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_a_resumed_run_under_torchrun_equals_the_unbroken_one(tmp_path, mode):
    """Checkpoint at step 3 of 6 (fsdp2: the shards gathered whole), resume from it on two ranks: the steps after it
    and the final weights are the unbroken run's (the judgements' memo is not saved, so judge counts differ)."""
    unbroken, w_unbroken = reclip(tmp_path, "unbroken", 2, f"trainer.distributed={mode}", "trainer.save_every=3")
    assert (tmp_path / "unbroken" / "checkpoint-3" / "state.pt").is_file()
    resumed, w_resumed = reclip(tmp_path, "resumed", 2, f"trainer.distributed={mode}",
                                f"trainer.resume={tmp_path / 'unbroken' / 'checkpoint-3'}")
    after = [r for r in phase(unbroken, "train") if r["step"] > 3]
    assert [r["step"] for r in phase(resumed, "train")] == [r["step"] for r in after] == [4, 5, 6]
    assert_same_run(after, w_unbroken, phase(resumed, "train"), w_resumed, phases=("train",),
                    keys=("loss", "grad_norm", "t2i/reward_mean", "i2t/reward_mean"))


@pytest.mark.slow  # ~30 s
def test_two_nodes_equal_one_process(tmp_path, single):
    """Two `torchrun --nnodes 2` launchers on one machine (c10d rendezvous, one process each, fsdp2): one job, one
    writer, the single process's run."""
    from tests.test_multinode import finish, launch_nodes, logs

    nodes = launch_nodes(tmp_path, "reclip", *RUN, f"trainer.output_dir={tmp_path / 'run'}",
                         "trainer.distributed=fsdp2", command=("reclip", "train"))
    codes, _ = finish(nodes, 600)
    assert codes == [0, 0], "\n".join(log[-2000:] for log in logs(tmp_path, "reclip"))
    two = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert_same_run(*single, two, load_file(next((tmp_path / "run" / "student").glob("*.safetensors"))))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("run")] == ["run"]  # global rank 0 wrote


def test_a_batch_that_does_not_split_over_the_ranks_is_refused(monkeypatch):
    from vlmrl.errors import ConfigError
    from vlmrl.reclip.config import load_reclip_config
    from vlmrl.reclip.trainer import join

    cfg = load_reclip_config(None, [*TINY, "rl.batch_size=9", "trainer.distributed=ddp"])
    monkeypatch.setattr("vlmrl.reclip.trainer.init_distributed",
                        lambda *a, **k: __import__("vlmrl.trainer.distributed", fromlist=["DistInfo"]).DistInfo(
                            "ddp", 0, 2, 0, "cpu"))
    with pytest.raises(ConfigError, match="rl.batch_size=9 must be a multiple of the number of processes"):
        join(cfg)
