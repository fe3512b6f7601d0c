"""Rollout ranks: under torchrun, the last `rollout.rollout_ranks` processes only generate, the others only train.

    torchrun --nproc_per_node 4 -m vlmrl train RECIPE trainer.distributed=fsdp2 \\
        rollout.asynchronous=true rollout.max_staleness=1 rollout.rollout_ranks=1

The training ranks (global ranks 0..T-1) form a process group of their own, which DDP or FSDP2, every metric
reduction and every checkpoint use; the rollout ranks (T..W-1) hold a full copy of the policy (and the vLLM engine,
with `rollout.engine=vllm`) and run stages I + II (`rl.produce`: generation, tools, rewards, judge calls) of the steps
training rank 0 asks for. It is the asynchronous producer of vlmrl.trainer.asynchronous on other processes (on other
GPUs), with the same contract: step s trains on answers sampled by version max(0, s - 1 - S), exactly; every draw from
the run's stream happens on the training ranks, in step order; the steps produced but not trained are saved in
checkpoints (training rank 0's `pending_rollouts.pt`: whole steps) and resume exactly.

Per training step s, every training rank in step: (1) before asking for step s + S, rank 0 takes the answers of the
steps it asked for earlier (the rollout ranks are then idle), (2) the rollout ranks get version s - 1's weights,
broadcast from rank 0 (under FSDP2 every training rank joins each parameter's gather), (3) rank 0 sends step s + S's
prompts to every rollout rank, which generates and scores its contiguous share of them (`shard`, as training ranks
do when they generate themselves), (4) rank 0 joins step s's shares and scatters to each training rank its own
share of the step's prompts, which it trains on while the rollout ranks generate step s + S.

Messages (prompts, answers, errors) travel pickled over a gloo group of all ranks (`Links.control`), weights over a
group of rank 0 and the rollout ranks in the run's backend (`Links.weights`: NCCL on GPUs). A rollout rank that
raises sends its traceback, and the run stops with it; one that answers nothing for `rollout.producer_timeout` seconds
stops the run with an error naming the step. Not with rollout ranks: dynamic sampling and curricula (they draw and
count groups while generating, on the training ranks' stream), LoRA (the rollout copy holds merged weights only) and
offline DPO (which samples nothing).
"""

from __future__ import annotations

import datetime
import io
import os
import pickle
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from vlmrl.deadlines import ROLLOUT_RANK_IDLE
from vlmrl.errors import ConfigError, TrainingError
from vlmrl.trainer.asynchronous import pending_file
from vlmrl.trainer.distributed import DistInfo, broadcast_object, full_parameters, join_process_group, process_device
from vlmrl.trainer.rl import Produced, concat_batches, keep_groups, produce
from vlmrl.trainer.types import StepContext


@dataclass
class Links:
    control: object  # gloo group of every rank: pickled messages
    weights: object  # training rank 0 and the rollout ranks, in the run's backend: the weights
    rollout: list[int]  # the rollout ranks' global ranks
    trainers: int  # training ranks (global ranks 0..trainers-1)


def split_ranks(mode: str, device: str, rollout_ranks: int, *, timeout: datetime.timedelta) -> DistInfo:
    """`init_distributed` for a split run: join torchrun's group and make the groups (every rank makes every group, in
    one order); the training ranks' `DistInfo` counts training ranks only, a rollout rank's the rollout ranks.

    Deadlines (vlmrl.deadlines): the collectives of the training ranks, of the rollout ranks and of the weights'
    broadcast wait `timeout` (`collective_timeout`); the control group, which a rollout rank waits on for the training
    ranks' next message, `ROLLOUT_RANK_IDLE` (the training ranks may be silent for hours: SFT, evaluations)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if mode == "none" or world <= rollout_ranks:
        raise ConfigError(f"rollout.rollout_ranks={rollout_ranks} needs torchrun with more processes than rollout "
                          f"ranks and trainer.distributed=ddp or fsdp2 (got {world} process(es), "
                          f"trainer.distributed={mode})")
    device = process_device(device, local_rank, world)
    join_process_group(device, local_rank, timeout)
    rank, trainers = dist.get_rank(), world - rollout_ranks
    train_group = dist.new_group(list(range(trainers)), timeout=timeout)
    rollout_group = dist.new_group(list(range(trainers, world)), timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=ROLLOUT_RANK_IDLE)
    weights = dist.new_group([0, *range(trainers, world)], timeout=timeout)
    links = Links(control, weights, list(range(trainers, world)), trainers)
    if rank < trainers:
        return DistInfo(mode, rank, trainers, local_rank, device, group=train_group, links=links)
    return DistInfo("none", rank - trainers, rollout_ranks, local_rank, device, group=rollout_group, links=links,
                    role="rollout")


# -- messages ----------------------------------------------------------------------------------------------------------
def send(obj, dst: int, links: Links) -> list:
    """Start sending `obj` (pickled by torch.save: tensors keep their device) to global rank `dst`; the returned
    handles must be kept until `finish`."""
    buffer = io.BytesIO()
    torch.save(obj, buffer, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    return [(dist.isend(size, dst, group=links.control), size), (dist.isend(payload, dst, group=links.control),
                                                                  payload)]


def finish(handles: list) -> None:
    for work, _ in handles:
        work.wait()
    handles.clear()


def receive(src: int, links: Links, timeout: float | None = None, what: str = "a message", device: str = "cpu"):
    """The next object global rank `src` sent; `timeout` seconds at most (None: the group's own timeout). A tensor the
    sender held on a GPU comes to `device` (the sender's GPU is another process's); CPU tensors stay on the CPU."""
    def wait(work) -> None:
        try:
            if timeout is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=timeout))
        except RuntimeError as exc:
            within = "" if timeout is None else f" within rollout.producer_timeout={timeout:g} s"
            raise TrainingError(f"no answer from rank {src}{within} while waiting for {what}: a rank that stopped, "
                                f"or a reward, tool or judge that never returns, ends the run like this ({exc})") \
                from exc

    size = torch.zeros(1, dtype=torch.int64)
    wait(dist.irecv(size, src, group=links.control))
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    wait(dist.irecv(payload, src, group=links.control))
    gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
    where = {f"cuda:{i}": device for i in range(gpus)} if gpus else None
    return torch.load(io.BytesIO(payload.numpy().tobytes()), map_location=where, weights_only=False)


# -- the weights ---------------------------------------------------------------------------------------------------
def broadcast_weights(ctx: StepContext) -> None:
    """Every training rank: the policy's full parameters, in order, to the rollout ranks (rank 0 broadcasts; under
    FSDP2 each parameter is gathered by all training ranks first)."""
    info = ctx.dist
    for full in full_parameters(ctx.policy, ctx.forward):
        if info.is_main:
            dist.broadcast(full.detach().contiguous(), src=0, group=info.links.weights)


def receive_weights(policy, links: Links) -> None:
    with torch.no_grad():
        for p in policy.model.parameters():
            dist.broadcast(p.data, src=0, group=links.weights)


# -- the training ranks' side -----------------------------------------------------------------------------------------
def share_of(out: Produced, part: int, parts: int, group_size: int) -> Produced:
    """Training rank `part`'s contiguous share of a whole step's prompts (and their answers)."""
    n = len(out.batch.samples)
    keep = torch.zeros(n, dtype=torch.bool)
    keep[part * n // parts:(part + 1) * n // parts] = True
    batch = keep_groups(out.batch, keep, group_size)
    first = batch if out.first is out.batch else keep_groups(out.first, keep, group_size)
    return Produced(batch, first, out.vision_calls / parts, out.seconds, out.version)


class RemoteRollouts:
    """`AsyncRollouts`' contract (`batch_for`, `metrics`, `save`, `load`, `close`) with the producer on the rollout
    ranks; every training rank holds one and calls it in step (module docstring)."""

    def __init__(self, ctx: StepContext, draw, max_staleness: int, timeout: float):
        self.ctx, self.draw, self.staleness, self.timeout = ctx, draw, max_staleness, timeout
        self.info: DistInfo = ctx.dist
        self.links: Links = self.info.links
        self.produced: dict[int, Produced] = {}  # rank 0: step -> the whole step's answers
        self.samples: dict[int, list[dict]] = {}  # rank 0: step -> its prompts, until trained
        self.outstanding: list[int] = []  # rank 0: steps asked for and not yet received, in order
        self.next_request: int | None = None
        self.copy_version: int | None = None
        self.dropped, self.waited = 0, 0.0
        self.sending: list = []

    def start(self, checkpoint: Path, version: int) -> None:
        """The rollout ranks load `checkpoint` (the trainer's weights, version `version`)."""
        if self.info.is_main:
            for r in self.links.rollout:
                self.sending += send(("start", str(checkpoint)), r, self.links)
        self.copy_version = version

    def _receive_outstanding(self) -> None:
        """Rank 0: the answers of every step asked for; the rollout ranks are idle after."""
        t0 = time.perf_counter()
        for step in self.outstanding:
            parts = []
            for r in self.links.rollout:
                kind, payload = receive(r, self.links, self.timeout, f"step {step}'s answers", self.info.device)
                if kind == "failed":
                    raise TrainingError(f"rollout rank {r} failed on step {step}:\n{payload}")
                parts.append(payload)
            out = parts[0] if len(parts) == 1 else Produced(
                concat_batches([p.batch for p in parts], self.ctx.policy.pad_token_id),
                concat_batches([p.first for p in parts], self.ctx.policy.pad_token_id),
                sum(p.vision_calls for p in parts), max(p.seconds for p in parts), parts[0].version)
            self.produced[step] = out
        self.outstanding = []
        finish(self.sending)
        self.waited += time.perf_counter() - t0

    def _push(self, version: int) -> None:
        if self.copy_version == version:
            return
        if self.info.is_main:
            self._receive_outstanding()
            for r in self.links.rollout:
                self.sending += send(("push", version), r, self.links)
        broadcast_weights(self.ctx)
        self.copy_version = version

    def _ask(self, step: int, version: int) -> None:
        if self.info.is_main:
            for r in self.links.rollout:
                self.sending += send(("produce", step, version, self.samples[step]), r, self.links)
            self.outstanding.append(step)

    def batch_for(self, step: int) -> Produced:
        """This training rank's share of step `step`'s answers, sampled by version max(0, step - 1 - S)."""
        version = step - 1
        if self.next_request is None:
            self.next_request = step
        while self.next_request <= step + self.staleness:
            samples = self.draw(self.next_request)  # every training rank draws: one stream, in step order
            self._push(version)
            if self.info.is_main:
                self.samples[self.next_request] = samples
            self._ask(self.next_request, version)
            self.next_request += 1
        out = None
        if self.info.is_main:
            if step not in self.produced:
                self._receive_outstanding()
            out = self.produced.pop(step)
        if broadcast_object(self.info.is_main and version - out.version > self.staleness, self.info):
            self.dropped += 1  # (a resume with a lower bound than the checkpoint's)
            self._push(version)
            self._ask(step, version)
            if self.info.is_main:
                self._receive_outstanding()
                out = self.produced.pop(step)
        parts = None
        if self.info.is_main:
            del self.samples[step]
            g = self.ctx.rollout.group_size
            parts = [share_of(out, k, self.info.world, g) for k in range(self.info.world)]
        if not self.info.active:
            return parts[0]
        mine = [None]
        dist.scatter_object_list(mine, parts, src=0, group=self.info.group)
        return mine[0]

    def metrics(self, step: int, out: Produced) -> dict[str, float]:
        m = {"async/staleness": float(step - 1 - out.version), "async/dropped_steps": float(self.dropped)}
        if self.info.is_main:
            m["async/wait_seconds"] = self.waited
        self.waited = 0.0
        return m

    def save(self, checkpoint: Path, rank: int) -> None:
        """Rank 0: the steps produced but not trained (whole steps), after the ones asked for are received."""
        if not self.info.is_main:
            return
        self._receive_outstanding()
        torch.save({"next_request": self.next_request, "produced": dict(self.produced),
                    "samples": dict(self.samples), "signal_share": None, "whole_steps": True},
                   pending_file(checkpoint, 0))

    def load(self, checkpoint: Path, rank: int) -> bool:
        state = None
        if self.info.is_main:
            path = pending_file(checkpoint, 0)
            state = torch.load(path, weights_only=False) if path.exists() else None
            if state is not None and not state.get("whole_steps"):
                raise TrainingError(f"{path}: saved by a run whose every rank generated its own share; resume it "
                                    "with rollout.rollout_ranks=0 (or start a new run from its weights)")
        self.next_request = broadcast_object(None if state is None else state["next_request"], self.info)
        if state is not None:
            self.produced.update(state["produced"])
            self.samples.update(state["samples"])
        return self.next_request is not None

    def close(self, failed: bool = False) -> None:
        """Rank 0 takes what it asked for and tells the rollout ranks to stop. `failed` (the run is ending with an
        error): nothing is waited for, since a rollout rank may never answer; torchrun ends them with the run."""
        if not self.info.is_main or failed:
            return
        self._receive_outstanding()
        for r in self.links.rollout:
            self.sending += send(("stop",), r, self.links)
        finish(self.sending)


# -- the rollout ranks' side ------------------------------------------------------------------------------------------
def serve_rollouts(cfg, info: DistInfo, rewards) -> dict:
    """A rollout rank's whole run: load the weights training rank 0 names, then take its messages until `stop`."""
    from vlmrl.agent import AgentSpec
    from vlmrl.eval.generative import Solved
    from vlmrl.models import load_policy

    links, m = info.links, cfg.model
    kind, start = receive(0, links, what="the start")
    policy = load_policy(start, m.dtype, info.device, m.min_pixels, m.max_pixels, m.autocast)
    engine = None
    if cfg.rollout.engine == "vllm":
        from vlmrl.rollout.vllm_engine import VLLMEngine, engine_options

        options = engine_options(cfg.rollout.vllm, m.dtype, m.autocast, info.device)
        engine = VLLMEngine(start, options, seed=cfg.trainer.seed, device=info.device)
    ctx = StepContext(policy, None, None, rewards, cfg.rollout, cfg.algorithm, cfg.trainer, cfg.data.prompt_template,
                      cfg.data.max_prompt_length, generator=torch.Generator().manual_seed(cfg.trainer.seed),
                      dist=info, engine=engine, agent=AgentSpec.from_config(cfg.agent, policy.processor),
                      solved=Solved.from_config(cfg))
    sending, steps = [], 0
    while True:
        message = receive(0, links, what="the next request")
        if message[0] == "push":
            receive_weights(policy, links)
            if engine is not None:
                engine.push_weights(policy)
        elif message[0] == "produce":
            _, step, version, samples = message
            ctx.step = step
            try:
                out = produce(ctx, samples)
                out.version = version
                reply = ("produced", out)
                steps += 1
            except Exception:  # the training ranks stop the run with it
                reply = ("failed", f"global rank {dist.get_rank()}:\n{traceback.format_exc()}")
            finish(sending)
            sending = send(reply, 0, links)
        elif message[0] == "stop":
            finish(sending)
            return {"rollout_rank": info.rank, "produced_steps": steps}
