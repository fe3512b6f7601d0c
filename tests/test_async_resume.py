"""Asynchronous runs resumed on another number of processes (issue 52): checkpoints hold whole pending steps, each
resumed rank trains the share of them that a freshly drawn step would give it, and what cannot continue exactly is
refused before the run starts (vlmrl/trainer/asynchronous.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlmrl.errors import ConfigError
from vlmrl.models.batch import PromptBatch
from vlmrl.rewards.output import RewardOutput
from vlmrl.rollout.generate import Rollout
from vlmrl.trainer.asynchronous import PENDING_FILE, check_pending, pending_file, step_share, whole_step
from vlmrl.trainer.distributed import DistInfo
from vlmrl.trainer.rl import Batch, Produced

from .test_train_e2e import GRPO, SMALL

G = 2
PAD = 0
# prompt p: its tokens (left-padded to 3 columns); answer row n: the token 100 + n, then padding
PROMPTS = [[11, 12, 13], [21], [31, 32], [41], [51, 52, 53], [61, 62]]


def step_of(prompts: list[int], version: int = 1) -> Produced:
    """A hand-made step: `prompts` (indices into PROMPTS), G answers each, answer row n rewarded 10 * prompt + n."""
    width = max(len(PROMPTS[p]) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(PROMPTS[p])) + PROMPTS[p] for p in prompts])
    rows = [(p, k) for p in prompts for k in range(G)]
    prompt_batch = PromptBatch([f"p{p}" for p in prompts], ids, (ids != PAD).long(), torch.zeros_like(ids),
                               images_per_prompt=[0] * len(prompts))  # (text-only prompts)
    completion = torch.tensor([[100 + 10 * p + k, PAD] for p, k in rows])
    rollout = Rollout(torch.arange(len(prompts)).repeat_interleave(G), completion, (completion != PAD).long(),
                      torch.zeros(completion.shape), torch.zeros(len(rows), dtype=torch.bool),
                      [f"a{p}.{k}" for p, k in rows])
    rewards = RewardOutput(torch.tensor([10.0 * p + k for p, k in rows]), {"r": [float(k) for _, k in rows]},
                           {"r": 0}, 0)
    batch = Batch([{"id": f"p{p}"} for p in prompts], prompt_batch, rollout, rewards, {"id": [f"p{p}" for p, _ in rows]},
                  correct=[k == 0 for _, k in rows])
    return Produced(batch, batch, vision_calls=len(prompts), seconds=1.0, version=version)


def ranks(world: int) -> list[DistInfo]:
    return [DistInfo("ddp", rank, world) for rank in range(world)]


def test_a_whole_step_is_shared_as_a_freshly_drawn_step_would_be():
    """6 prompts on 3 ranks: rank 1 takes prompts 2 and 3 (the second third, as `shard` splits a drawn step), its
    answers rows 4-7 renumbered to prompts 0, 0, 1, 1, their rewards 20, 21, 30, 31, and the prompts' common left
    padding (prompt 2 has one padding column, prompt 3 two) trimmed to one column."""
    whole = step_of([0, 1, 2, 3, 4, 5])
    share = step_share(whole, DistInfo("ddp", 1, 3), G)
    b = share.batch
    assert [s["id"] for s in b.samples] == ["p2", "p3"] and b.prompts.sample_ids == ["p2", "p3"]
    assert b.prompts.input_ids.tolist() == [[31, 32], [0, 41]]
    assert b.rollout.prompt_index.tolist() == [0, 0, 1, 1]
    assert b.rollout.completion_ids[:, 0].tolist() == [120, 121, 130, 131]
    assert b.rollout.texts == ["a2.0", "a2.1", "a3.0", "a3.1"]
    assert b.rewards.total.tolist() == [20.0, 21.0, 30.0, 31.0]
    assert b.columns["id"] == ["p2", "p2", "p3", "p3"] and b.correct == [True, False, True, False]
    assert share.first is share.batch and share.version == 1 and share.vision_calls == 2.0  # 6 calls / 3 ranks
    assert step_share(whole, DistInfo("none", 0, 1), G) is whole  # one process trains the whole step


@pytest.mark.parametrize("saved, resumed", [(2, 1), (1, 2), (2, 3), (3, 2)])
def test_shares_joined_and_shared_again_are_the_new_ranks_fresh_shares(saved, resumed):
    """A step generated on `saved` ranks, joined by rank 0 into the whole step and shared over `resumed` ranks: each
    new rank holds exactly the prompts and answers it would have drawn and generated itself."""
    prompts = [0, 1, 2, 3, 4, 5]
    shares = [step_of(prompts[r * 6 // saved:(r + 1) * 6 // saved]) for r in range(saved)]
    whole = whole_step(shares, PAD)
    assert [s["id"] for s in whole.batch.samples] == [f"p{p}" for p in prompts] and whole.vision_calls == 6
    for info in ranks(resumed):
        got, fresh = step_share(whole, info, G).batch, step_of(prompts[info.rank * 6 // resumed:
                                                                      (info.rank + 1) * 6 // resumed]).batch
        assert got.prompts.sample_ids == fresh.prompts.sample_ids
        assert torch.equal(got.prompts.input_ids, fresh.prompts.input_ids)
        assert got.rollout.texts == fresh.rollout.texts
        assert torch.equal(got.rollout.prompt_index, fresh.rollout.prompt_index)
        assert torch.equal(got.rollout.completion_ids, fresh.rollout.completion_ids)
        assert torch.equal(got.rewards.total, fresh.rewards.total)


def save_pending(checkpoint: Path, steps: dict[int, Produced], whole: bool = True, shares: int = 1) -> None:
    checkpoint.mkdir(parents=True, exist_ok=True)
    state = {"next_request": max(steps) + 1, "produced": steps,
             "samples": {s: out.batch.samples for s, out in steps.items()}, "signal_share": None}
    if whole:
        state["whole_steps"] = True
    for rank in range(shares):
        torch.save(state, pending_file(checkpoint, rank))


def test_a_pending_step_that_does_not_split_over_the_new_processes_is_refused(tmp_path):
    save_pending(tmp_path / "checkpoint-2", {3: step_of([0, 1, 2, 3, 4, 5])})
    for world in (1, 2, 3, 6):
        check_pending(tmp_path / "checkpoint-2", world)
    with pytest.raises(ConfigError, match=r"step 3, produced but not trained, has 6 prompts, which do not split "
                                          r"evenly over 4 processes.*divides 6 \(1, 2, 3, 6\)"):
        check_pending(tmp_path / "checkpoint-2", 4)
    check_pending(tmp_path / "synchronous", 4)  # no pending steps: nothing to check


def test_a_checkpoint_of_per_rank_shares_resumes_only_on_as_many_processes(tmp_path):
    """Checkpoints from before whole steps hold each rank's share in its own file: they resume on as many processes
    (each rank loads its own file), and are refused on another number, saying how to go on."""
    ckpt = tmp_path / "checkpoint-2"
    save_pending(ckpt, {3: step_of([0, 1])}, whole=False, shares=2)
    assert (ckpt / PENDING_FILE).exists() and (ckpt / "pending_rollouts-rank1.pt").exists()
    check_pending(ckpt, 2)
    save_pending(tmp_path / "one", {3: step_of([0, 1])}, whole=False)  # one process's share is the whole step
    check_pending(tmp_path / "one", 2)
    for world in (1, 3):
        with pytest.raises(ConfigError, match=rf"saved as 2 shares, one per process .* this run has {world} "
                                              r"process\(es\).*torchrun --nproc_per_node=2\)"):
            check_pending(ckpt, world)


# -- whole runs under torchrun (gloo, CPU) --------------------------------------------------------------------------
# every step's prompts and answer count, as each rank trains them, appended to $VLMRL_TEST_STEPS-rank$RANK.jsonl
SPY = """import json, os, runpy, sys
import vlmrl.trainer.job as job
_learn = job.learn
def learn(ctx, produced, *args, **kwargs):
    with open(f"{os.environ['VLMRL_TEST_STEPS']}-rank{os.environ.get('RANK', '0')}.jsonl", "a") as f:
        f.write(json.dumps({"step": ctx.step, "ids": [s["id"] for s in produced.batch.samples],
                            "answers": len(produced.batch.rollout.texts)}) + "\\n")
    return _learn(ctx, produced, *args, **kwargs)
job.learn = learn
sys.argv = ["vlmrl", *sys.argv[1:]]
runpy.run_module("vlmrl", run_name="__main__")
"""
ARGS = [*SMALL, "rollout.prompts_per_step=4", "rollout.asynchronous=true", "rollout.max_staleness=1",
        "trainer.save_every=2", "trainer.log_rollouts_every=0", "trainer.lr=1e-2"]
REWARD = "def score(completions, **columns):\n    return [float(len(c) % 3) for c in completions]\n"


def launch(root: Path, log: str, nproc: int, *args: str) -> subprocess.CompletedProcess:
    """`vlmrl train ARGS` in `nproc` processes (DDP under torchrun when several), through the spy."""
    spy = root / "spy.py"
    spy.write_text(SPY)
    cmd = [str(spy), "train", *args]
    if nproc > 1:
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLMRL_TEST_STEPS": str(root / log),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=300, env=env, cwd=root)


def new_run(root: Path, name: str, nproc: int, steps: int) -> None:
    (root / "reward.py").write_text(REWARD)
    mode = "ddp" if nproc > 1 else "none"
    done = launch(root, name, nproc, GRPO, *ARGS, f"trainer.steps={steps}", f"trainer.output_dir={root / name}",
                  f"trainer.distributed={mode}", f"rewards=[{{name: '{root / 'reward.py'}:score', isolate: false}}]")
    assert done.returncode == 0, done.stderr[-3000:]


def resume(root: Path, name: str, nproc: int, checkpoint: str, steps: int, ok: bool = True) -> str:
    mode = "ddp" if nproc > 1 else "none"
    done = launch(root, f"{name}-resumed", nproc, "--resume", str(root / name / checkpoint), f"trainer.steps={steps}",
                  f"trainer.distributed={mode}")
    assert (done.returncode == 0) == ok, done.stderr[-3000:]
    return done.stderr


def trained(root: Path, *logs: str) -> dict[int, tuple[list[str], int]]:
    """step -> (the prompt ids every rank trained, in rank order; the answers they trained), over the runs `logs`."""
    out: dict[int, tuple[list[str], int]] = {}
    for log in logs:
        for file in sorted(root.glob(f"{log}-rank*.jsonl")):  # (rank 0 first)
            for row in map(json.loads, file.read_text().splitlines()):
                ids, answers = out.get(row["step"], ([], 0))
                out[row["step"]] = (ids + row["ids"], answers + row["answers"])
    return out


def rewards(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["reward/total/mean"] for r in rows if r["phase"] == "train"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One process, 4 steps, checkpoints at steps 2 and 4 (step 3 produced, not trained, at checkpoint-2)."""
    root = tmp_path_factory.mktemp("async-resume")
    new_run(root, "one", 1, 4)
    steps = trained(root, "one")
    assert sorted(steps) == [1, 2, 3, 4] and all(len(ids) == 4 and n == 12 for ids, n in steps.values())
    assert len({i for ids, _ in steps.values() for i in ids}) == 16  # 4 steps of 4 distinct prompts (of 40)
    return root, steps, rewards(root / "one")


@pytest.fixture(scope="module")
def two_processes(uninterrupted):
    """2 DDP processes to step 2: checkpoint-2 holds step 3's answers, produced half on each rank."""
    root = uninterrupted[0]
    new_run(root, "two", 2, 2)
    return root / "two"


def copied(run_dir: Path, name: str) -> str:
    shutil.copytree(run_dir, run_dir.with_name(name))
    return name


@pytest.mark.slow  # ~10-15 s on 2 cores, after the two module runs (~25-35 s)
def test_an_asynchronous_run_saved_on_two_processes_resumes_on_one_with_every_prompt(uninterrupted, two_processes):
    """2 DDP processes to step 2 (step 3's answers produced, half on each rank), resumed in one process to step 4:
    every step trains the uninterrupted run's prompts, in its order, and their 12 answers, with its rewards."""
    root, steps, reward = uninterrupted
    shutil.copytree(two_processes, root / "two-1")
    for name in ("two-rank0.jsonl", "two-rank1.jsonl"):  # (steps 1 and 2, as the 2 processes trained them)
        shutil.copy(root / name, root / name.replace("two", "two-1"))
    resume(root, "two-1", 1, "checkpoint-2", 4)
    assert trained(root, "two-1", "two-1-resumed") == steps
    assert not list((root / "two-1" / "checkpoint-2").glob("pending_rollouts-rank*"))  # one file, whole steps
    assert rewards(root / "two-1") == pytest.approx(reward, abs=1e-6)


@pytest.mark.slow  # ~20-25 s on 2 cores
def test_an_asynchronous_run_saved_on_one_process_resumes_on_two_with_every_prompt(uninterrupted):
    """The uninterrupted one-process run's checkpoint-2 (step 3's answers produced, whole), resumed by 2 DDP processes
    to step 4: each rank trains its half of step 3 and draws step 4 in step with the other, as one process did."""
    root, steps, reward = uninterrupted
    shutil.copytree(root / "one", root / "one-copy")
    resume(root, "one-copy", 2, "checkpoint-2", 4)
    later = trained(root, "one-copy-resumed")
    assert later == {s: steps[s] for s in (3, 4)}
    for rank in (0, 1):  # each rank its own contiguous half, as it would draw it
        rows = [json.loads(x) for x in (root / f"one-copy-resumed-rank{rank}.jsonl").read_text().splitlines()]
        assert {r["step"]: r["ids"] for r in rows} == {s: steps[s][0][2 * rank:2 * rank + 2] for s in (3, 4)}
    assert rewards(root / "one-copy") == pytest.approx(reward, abs=1e-6)


@pytest.mark.slow  # ~15-30 s on 2 cores
def test_a_checkpoint_of_per_rank_shares_resumes_on_as_many_processes_and_is_refused_on_others(uninterrupted,
                                                                                              two_processes):
    """checkpoint-2 of the 2-process run rewritten as checkpoints were before whole steps (each rank's share in its
    own file): resumed by 2 processes it trains every prompt as before; one process refuses it before any step."""
    from vlmrl.rundir import MARKER

    root, steps, _ = uninterrupted
    shutil.copytree(two_processes, root / "old")
    for name in ("two-rank0.jsonl", "two-rank1.jsonl"):
        shutil.copy(root / name, root / name.replace("two", "old"))
    ckpt = root / "old" / "checkpoint-2"
    state = torch.load(pending_file(ckpt, 0), weights_only=False)
    del state["whole_steps"]
    whole = state["produced"]
    for rank in (0, 1):
        state["produced"] = {step: step_share(out, DistInfo("ddp", rank, 2), 3) for step, out in whole.items()}
        torch.save(state, pending_file(ckpt, rank))
    marker = json.loads((ckpt / MARKER).read_text())  # (the sizes a complete checkpoint lists)
    marker["files"] |= {p.name: p.stat().st_size for p in ckpt.glob("pending_rollouts*.pt")}
    (ckpt / MARKER).write_text(json.dumps(marker))
    said = resume(root, "old", 1, "checkpoint-2", 4, ok=False)
    assert "saved as 2 shares, one per process" in said and "torchrun --nproc_per_node=2" in said
    assert not (root / "old-resumed-rank0.jsonl").exists()  # refused before any step
    resume(root, "old", 2, "checkpoint-2", 4)
    assert trained(root, "old", "old-resumed") == steps
