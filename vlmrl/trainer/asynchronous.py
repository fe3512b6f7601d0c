"""Asynchronous rollouts with bounded staleness (`rollout.asynchronous`): a producer samples and scores the next
steps' answers while the trainer trains on this step's.

Versions: the trainer's weights after k optimizer updates of the RL phase are version k; step s trains version s - 1.
With `max_staleness` S, step s trains on answers sampled by version max(0, s - 1 - S), exactly: S = 0 is
synchronous training (the answers of step s come from the weights step s trains), S = 1 trains every step on the
answers of the version before (after the first, which has nothing older). The off-policy gap this leaves is what
`algorithm.rollout_correction` corrects (`auto`: token TIS) and the `mismatch/*` metrics measure.

How, in one process: a producer thread runs stages I + II (`rl.produce`: generation, rewards, tools, image
preprocessing) on a copy of the policy (S > 0; the rollout engine when `rollout.engine=vllm`), one step at a time,
in order. Where the next step's generation does not depend on this step's scores (S > 0, no dynamic sampling, no
curriculum, not ReMax), stage II runs on a scorer thread of its own: the rewards and judge calls of step k overlap the
generation of step k + 1, and the answers, scores and updates are those of scoring each step before the next. At the start of step s the trainer (1) waits until the producer has finished what it was given, (2) hands
the copy the current weights (version s - 1), (3) draws the prompts of step s + S and gives them to the producer,
(4) takes step s's answers and trains on them while the producer generates step s + S. Every draw from the run's
random stream happens on the trainer's thread, in step order, so a run repeats exactly; the producer's sampling uses
each prompt's own seed (`rl.prompt_seed`). Under torchrun every rank runs its own producer on its shard; the producer
makes no collective. With `rollout.rollout_ranks` the producer is on processes of its own instead
(vlmrl.trainer.rollout_ranks), with the same contract.

Answers older than the bound (only possible when a run is resumed with a lower `max_staleness` than it saved with)
are dropped, counted in `async/dropped_steps`, and sampled again from the current weights. A producer that raises
stops the run with its error; one that has given nothing for `rollout.producer_timeout` seconds stops it with an
error naming the step, instead of hanging.

Checkpoints save the produced-but-not-trained steps, so a resumed run trains on exactly the answers the uninterrupted
run would have; a checkpoint first waits for the step being generated. They are saved as whole steps: rank 0 gathers
every rank's share of each step into one `pending_rollouts.pt` (as rollout ranks' runs save theirs), and a run resumed
on any number of processes gives each rank the share `shard` gives it of a freshly drawn step (`step_share`), while
the prompt stream continues after them. What cannot continue exactly is refused before the run starts
(`check_pending`): a pending step whose prompts do not split evenly over the new processes, or a checkpoint from
before whole steps with one `pending_rollouts-rankN.pt` per rank (several processes' shares) resumed on another
number of processes.

What staleness costs: the copy's memory (a second set of weights; none at S = 0), and a bias unless corrected. What
it buys: generation overlaps training. On a 2-core CPU both compete for the same cores (BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import queue
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from vlmrl.deadlines import THREAD_EXIT_S
from vlmrl.errors import ConfigError, TrainingError
from vlmrl.models.policy import Policy
from vlmrl.trainer.distributed import DistInfo, TrainingForward, full_parameters, gathered, shard
from vlmrl.trainer.rl import Produced, concat_batches, generate_step, keep_groups, produce, score_step
from vlmrl.trainer.types import StepContext

PENDING_FILE = "pending_rollouts.pt"


def pending_file(checkpoint: Path, rank: int) -> Path:
    """Where a checkpoint keeps the steps produced but not trained: `pending_rollouts.pt` (whole steps); checkpoints
    from before whole steps also hold one `pending_rollouts-rankN.pt` per rank N > 0 (rank 0's share in the first)."""
    return Path(checkpoint) / (PENDING_FILE if rank == 0 else f"pending_rollouts-rank{rank}.pt")


def whole_step(shares: list[Produced], pad_token_id: int) -> Produced:
    """One step's shares, in rank order, joined into the whole step: its prompts in the order they were drawn."""
    if len(shares) == 1:
        return shares[0]
    batch = concat_batches([s.batch for s in shares], pad_token_id)
    first = batch if all(s.first is s.batch for s in shares) else \
        concat_batches([s.first for s in shares], pad_token_id)
    return Produced(batch, first, sum(s.vision_calls for s in shares), max(s.seconds for s in shares),
                    shares[0].version)


def step_share(out: Produced, info: DistInfo, group_size: int) -> Produced:
    """This rank's share of a whole step: the contiguous prompts (and their G answers each) that `shard` gives it,
    as when a step is drawn on these ranks and each generates its own share. E.g. 6 prompts on 3 ranks: rank 1 takes
    prompts 2 and 3, answer rows 2G..4G-1. The step's vision-tower calls are split evenly (the metric is a mean over
    the ranks)."""
    if not info.active:
        return out

    def mine(batch):
        n = len(batch.samples)
        start, stop = shard(n, info)
        keep = torch.zeros(n, dtype=torch.bool)
        keep[start:stop] = True
        return keep_groups(batch, keep, group_size)

    batch = mine(out.batch)
    first = batch if out.first is out.batch else mine(out.first)
    return Produced(batch, first, out.vision_calls / info.world, out.seconds, out.version)


def check_pending(checkpoint: Path, world: int) -> None:
    """Refuse (ConfigError) to resume `checkpoint` on `world` processes where its pending steps cannot continue
    exactly: a checkpoint of several processes from before whole steps (each rank saved only its share) on another
    number of processes, or a step whose prompts do not split evenly over `world`. Reads only the file's index (its
    tensors are mapped, not loaded)."""
    checkpoint = Path(checkpoint)
    path = pending_file(checkpoint, 0)
    if not path.exists():
        return
    saved = 1 + len(list(checkpoint.glob("pending_rollouts-rank*.pt")))
    if saved > 1:  # (one process's share of a step is the whole step)
        if saved != world:
            raise ConfigError(
                f"{checkpoint}: its steps produced but not trained were saved as {saved} shares, one per process "
                f"(pending_rollouts*.pt, from before checkpoints held whole steps), and this run has {world} "
                f"process(es), so some of their prompts would be lost or drawn again: resume it on {saved} "
                f"process(es) (torchrun --nproc_per_node={saved}); its next checkpoint holds whole steps, which "
                "resume on any number of processes")
        return
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    for step in sorted(state["samples"]):
        counts = {len(state["samples"][step])}
        if step in state["produced"]:
            out = state["produced"][step]
            counts |= {len(out.batch.samples), len(out.first.samples)}
        if any(n % world for n in counts):
            n = next(c for c in sorted(counts) if c % world)
            fits = ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)
            raise ConfigError(f"{checkpoint}: step {step}, produced but not trained, has {n} prompts, which do not "
                              f"split evenly over {world} processes (each trains an equal share of a step): resume "
                              f"it on a number of processes that divides {n} ({fits})")


def device_map(device: str) -> dict[str, str] | None:
    """`torch.load`'s map_location for tensors another rank saved from its GPU: onto this rank's `device` (CPU
    tensors stay on the CPU)."""
    gpus = torch.cuda.device_count() if str(device).startswith("cuda") else 0
    return {f"cuda:{i}": str(device) for i in range(gpus)} if gpus else None


class AsyncRollouts:
    """The producer and its bounded queue of produced steps. `draw(step)` returns the prompts of a step (drawn on the
    trainer's thread, in step order); `rollout_policy`: the copy the producer samples with (None: S = 0 or a rollout
    engine, which samples with its own weights); `resample(k)`: dynamic sampling's extra prompts.

    Dynamic sampling and the curriculum draw from the run's stream on the producer's thread too (extra rounds; pass
    rates): never at the same time as the trainer, whose own draws wait until the producer is idle, and whose update
    draws nothing when it runs one minibatch without SFT replay (the recipe rule that allows them with S > 0)."""

    def __init__(self, ctx: StepContext, draw, max_staleness: int, timeout: float,
                 rollout_policy: Policy | None = None, resample=None):
        self.ctx, self.draw, self.staleness, self.timeout = ctx, draw, max_staleness, timeout
        self.resample = resample  # dynamic sampling's draw of k more prompts (on the producer's thread)
        self.signal_share = ctx.signal_share
        self.rollout_policy = rollout_policy
        self.copy_version: int | None = None  # the version the copy (or engine) holds
        self.produced: dict[int, Produced] = {}  # step -> its answers, produced or loaded from a checkpoint
        self.samples: dict[int, list[dict]] = {}  # step -> its prompts (all ranks'), until it is trained
        self.next_request: int | None = None  # the first step not yet given to the producer
        self.dropped = 0
        self.waited = 0.0
        self._requests: queue.Queue = queue.Queue()
        self._done = threading.Condition()
        self._busy: int | None = None  # the step being generated
        self._busy_since = 0.0
        self._error: BaseException | None = None
        self._error_text = ""
        # stage II (rewards, judge calls) of step k overlaps stage I of step k + 1 on a thread of its own, where the
        # next step's generation does not depend on this step's scores: no dynamic sampling (it resamples on them and
        # sizes the next draw by them) and no curriculum (its pass rates choose the next prompts)
        # (ReMax, which samples again while scoring, is refused with asynchronous rollouts)
        self.pipelined = max_staleness > 0 and not ctx.algorithm.dynamic_sampling and ctx.observe is None
        self._scoring: set[int] = set()  # steps generated, being scored
        self._scores: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="vlmrl-rollout-producer", daemon=True)
        self._thread.start()
        self._scorer = None
        if self.pipelined:
            self._scorer = threading.Thread(target=self._score, name="vlmrl-rollout-scorer", daemon=True)
            self._scorer.start()

    # -- the producer thread -----------------------------------------------------------------------------------------
    def _context(self, step: int) -> StepContext:
        policy = self.rollout_policy or self.ctx.policy
        forward = self.ctx.forward if self.rollout_policy is None else TrainingForward(policy)
        return dataclasses.replace(self.ctx, policy=policy, forward=forward, step=step)

    def _work(self) -> None:
        while True:
            item = self._requests.get()
            if item is None:
                return
            step, version, samples = item
            try:
                ctx = self._context(step)
                if self.pipelined:  # stage I here; the scorer takes stage II while the next step generates
                    generated = generate_step(ctx, samples)
                else:
                    out = produce(ctx, samples, self.resample)
                    out.version = version
            except BaseException as exc:  # handed to the trainer's thread, which stops the run with it
                self._fail(exc)
                return
            with self._done:
                if self.pipelined:
                    self._scoring.add(step)
                    self._scores.put((step, version, samples, generated, ctx))
                else:
                    self.produced[step] = out
                    self.signal_share = ctx.signal_share  # (dynamic sampling: the next draw's size follows it)
                self._busy = None
                self._done.notify_all()

    def _score(self) -> None:
        while True:
            item = self._scores.get()
            if item is None:
                return
            step, version, samples, generated, ctx = item
            try:
                out = score_step(ctx, samples, generated)
                out.version = version
            except BaseException as exc:
                self._fail(exc)
                return
            with self._done:
                self.produced[step] = out
                self._scoring.discard(step)
                self._done.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self._done:
            self._error, self._error_text = exc, traceback.format_exc()
            self._busy = None
            self._scoring.clear()
            self._done.notify_all()

    # -- the trainer's side ------------------------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise TrainingError(f"the rollout producer failed: {type(self._error).__name__}: {self._error}\n"
                                f"{self._error_text}") from self._error

    def _wait(self, until) -> None:
        """Wait until `until()` holds (under the lock); a failed or stuck producer raises instead of hanging."""
        t0 = time.perf_counter()
        with self._done:
            while not until():
                self._raise_if_failed()
                if not self._thread.is_alive() or (self._scorer is not None and not self._scorer.is_alive()):
                    raise TrainingError("the rollout producer stopped without an error; the run cannot go on")
                left = self.timeout - (time.perf_counter() - t0)
                if left <= 0:
                    busy = f"step {self._busy}'s answers for {time.perf_counter() - self._busy_since:.0f} s" \
                        if self._busy is not None else "nothing"
                    if self._scoring:
                        busy += f" (and scoring step {min(self._scoring)}'s)"
                    raise TrainingError(f"no rollouts after rollout.producer_timeout={self.timeout:g} s: the "
                                        f"producer has been generating {busy}; a reward, tool or judge that never "
                                        f"returns stops it like this (raise the timeout if generation is that slow)")
                self._done.wait(min(left, 1.0))
            self._raise_if_failed()
        self.waited += time.perf_counter() - t0

    def _push(self, version: int) -> None:
        """Give the copy (or engine) the trainer's current weights, version `version`; the producer is idle."""
        if self.copy_version == version:
            return
        ctx = self.ctx
        if ctx.engine is not None:
            with gathered(ctx.forward):
                ctx.engine.push_weights(ctx.policy)
        elif self.rollout_policy is not None:
            with torch.no_grad():
                for src, dst in zip(full_parameters(ctx.policy, ctx.forward), self.rollout_policy.model.parameters(),
                                    strict=True):
                    dst.copy_(src)
        self.copy_version = version

    def _request(self, step: int, version: int) -> None:
        self._wait(lambda: self._busy is None)
        self._push(version)
        self.ctx.signal_share = self.signal_share  # the share of the last step produced
        self.samples[step] = self.draw(step)
        self._give(step, version, self.samples[step])

    def _give(self, step: int, version: int, samples: list[dict]) -> None:
        with self._done:
            self._busy, self._busy_since = step, time.perf_counter()
        self._requests.put((step, version, samples))

    def batch_for(self, step: int) -> Produced:
        """Step `step`'s answers, sampled by version max(0, step - 1 - S) (the trainer holds version step - 1);
        requests the steps up to step + S first."""
        version = step - 1
        if self.next_request is None:
            self.next_request = step
        while self.next_request <= step + self.staleness:
            self._request(self.next_request, version)
            self.next_request += 1
        self._wait(lambda: step in self.produced)
        out = self.produced.pop(step)
        if version - out.version > self.staleness:  # (a resume with a lower bound than the checkpoint's)
            self.dropped += 1
            self._wait(lambda: self._busy is None)
            self._push(version)
            self._give(step, version, self.samples[step])
            self._wait(lambda: step in self.produced)
            out = self.produced.pop(step)
        del self.samples[step]
        return out

    def metrics(self, step: int, out: Produced) -> dict[str, float]:
        m = {"async/staleness": float(step - 1 - out.version), "async/dropped_steps": float(self.dropped),
             "async/wait_seconds": self.waited}
        self.waited = 0.0
        return m

    # -- checkpoints -------------------------------------------------------------------------------------------------
    def save(self, checkpoint: Path, rank: int) -> None:
        """The produced-but-not-trained steps, after the one being generated (and scored) is done: every rank sends
        its shares to rank 0, which saves the whole steps (module docstring). Every rank must call it."""
        self._wait(lambda: self._busy is None and not self._scoring)
        info = self.ctx.dist
        shares = [dict(self.produced)]
        if info.active:  # pickled by torch.save, so that a GPU tensor keeps its device, mapped to rank 0's on load
            buffer = io.BytesIO()
            torch.save(shares[0], buffer, pickle_protocol=pickle.HIGHEST_PROTOCOL)
            every = [None] * info.world if info.is_main else None
            dist.gather_object(buffer.getvalue(), every, dst=0, group=info.group)
            if not info.is_main:
                return
            shares = [torch.load(io.BytesIO(b), map_location=device_map(info.device), weights_only=False)
                      for b in every]
        pad = self.ctx.policy.pad_token_id
        produced = {step: whole_step([s[step] for s in shares], pad) for step in shares[0]}
        torch.save({"next_request": self.next_request, "produced": produced, "samples": dict(self.samples),
                    "signal_share": self.signal_share, "whole_steps": True}, pending_file(checkpoint, 0))

    def load(self, checkpoint: Path, rank: int) -> bool:
        """Steps a checkpoint saved as produced, this rank's share of each (False: it saved none, e.g. a synchronous
        run's). `check_pending` has refused what cannot continue exactly on these processes."""
        path = pending_file(checkpoint, 0)
        if not path.exists():
            return False
        info = self.ctx.dist
        state = torch.load(path, map_location=device_map(info.device), weights_only=False)
        if pending_file(checkpoint, 1).exists():  # saved before whole steps, one share per rank, on as many processes
            if rank:
                state = torch.load(pending_file(checkpoint, rank), weights_only=False)
        else:  # whole steps (also a rollout-ranks run's, resumed here without rollout ranks, or one process's)
            g = self.ctx.rollout.group_size
            state["produced"] = {step: step_share(out, info, g) for step, out in state["produced"].items()}
        self.produced.update(state["produced"])
        self.samples.update(state["samples"])
        self.signal_share = state["signal_share"]
        self.next_request = state["next_request"]
        return True

    def close(self, failed: bool = False) -> None:
        self._requests.put(None)
        self._scores.put(None)
        self._thread.join(timeout=THREAD_EXIT_S)
        if self._scorer is not None:
            self._scorer.join(timeout=THREAD_EXIT_S)
