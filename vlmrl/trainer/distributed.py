"""Data-parallel training through PyTorch's own machinery: torchrun + DDP or FSDP2 (`fully_shard`).

    torchrun --nproc_per_node 2 -m vlmrl train recipes/quickstart.yaml trainer.distributed=ddp

Each rank takes a contiguous shard of the step's prompts (a group never spans ranks) and samples them from the same
per-prompt random streams as a single process would, so a step computes the same global batch however many ranks
share it. The training forward runs as one module call (`TrainingForward`), which DDP or FSDP2 wraps; gradients are
averaged across ranks by the wrapper and every loss is normalised by the whole step's token and sequence counts, so
the update equals the single-process one. gloo on CPU, NCCL on GPU; logging and checkpoints on rank 0.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from vlmrl.errors import ConfigError
from vlmrl.models.forward import CompletionOutput, sequence_logprobs
from vlmrl.models.policy import Policy


@dataclass
class DistInfo:
    mode: str = "none"  # none | ddp | fsdp2
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "cpu"  # this process's device: model.device, with "cuda" mapped to cuda:LOCAL_RANK under torchrun
    # with rollout ranks (rollout.rollout_ranks, vlmrl.trainer.rollout_ranks): the training ranks' own process group
    # (rank and world count training ranks only: they are global ranks 0..world-1) and the links to the rollout ranks;
    # None: every process trains (the default group)
    group: object | None = None
    links: object | None = None  # vlmrl.trainer.rollout_ranks.Links (training ranks) or the rollout rank's own
    role: str = "train"  # train | rollout

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def process_device(device: str, local_rank: int, world: int) -> str:
    """The device of this process: under torchrun each rank takes its own GPU, `cuda` -> `cuda:LOCAL_RANK`.

    An explicit `cuda:K` is kept in a single process and refused under torchrun with several ranks (all of them would
    share GPU K, which NCCL rejects)."""
    if not device.startswith("cuda") or world == 1:
        return device
    if device not in ("cuda", f"cuda:{local_rank}"):
        raise ConfigError(f"model.device={device!r} under torchrun with {world} processes: use model.device=cuda, and "
                         f"each rank takes cuda:LOCAL_RANK")
    return f"cuda:{local_rank}"


def init_distributed(mode: str, device: str, *, timeout: datetime.timedelta) -> DistInfo:
    """Join the process group torchrun set up (RANK / WORLD_SIZE / LOCAL_RANK); a plain `python -m vlmrl` run is
    world size 1. On GPUs every rank binds its own device (`cuda:LOCAL_RANK`) before NCCL starts, and the policy,
    reference, critic and vLLM engine are all placed on `DistInfo.device`. `timeout`: every collective's deadline
    (vlmrl.deadlines.collective_timeout). (With rollout ranks: vlmrl.trainer.rollout_ranks.split_ranks.)"""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if mode == "none" or world == 1:
        device = process_device(device, 0, 1)
        if device.startswith("cuda") and torch.cuda.is_available():
            torch.cuda.set_device(torch.device(device))
        return DistInfo(mode, 0, 1, 0, device)
    device = process_device(device, local_rank, world)
    join_process_group(device, local_rank, timeout)
    return DistInfo(mode, dist.get_rank(), dist.get_world_size(), local_rank, device)


def join_process_group(device: str, local_rank: int, timeout: datetime.timedelta) -> None:
    """torchrun's default group: NCCL on this rank's GPU, gloo on the CPU; `timeout` bounds each of its collectives
    (not torch's default, which depends on the backend: vlmrl.deadlines)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=timeout)
    elif not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timeout)


def shard(n: int, info: DistInfo) -> tuple[int, int]:
    """[start, stop) of this rank's prompts among n; n must split evenly so every rank does the same work."""
    if n % info.world:
        raise ConfigError(f"rollout.prompts_per_step={n} must be a multiple of the number of processes ({info.world})")
    per = n // info.world
    return info.rank * per, (info.rank + 1) * per


def _reduce(x: float | Tensor, info: DistInfo, op) -> Tensor:
    """`x` reduced over the ranks, as a float64 CPU tensor. The reduction runs on the rank's device, since NCCL
    reduces CUDA tensors only (gloo: CPU)."""
    t = torch.as_tensor(x, dtype=torch.float64).detach().clone()
    if info.active:
        device = str(info.device)
        t = t.to(device if device.startswith("cuda") else "cpu")
        dist.all_reduce(t, op=op, group=info.group)
    return t.cpu()


def all_sum(x: float | Tensor, info: DistInfo) -> Tensor:
    return _reduce(x, info, dist.ReduceOp.SUM)


def all_max(x: float | Tensor, info: DistInfo) -> Tensor:
    return _reduce(x, info, dist.ReduceOp.MAX)


def whole_ranks(n: int, info: DistInfo) -> int:
    """n rounded up to a multiple of the number of processes: every rank generates for as many prompts."""
    return -(-n // info.world) * info.world


def gather_lists(values: list, info: DistInfo) -> list:
    """Every rank's list, joined in rank order (one process: `values`). Small Python objects only (pickled)."""
    if not info.active:
        return list(values)
    out: list = [None] * info.world
    dist.all_gather_object(out, list(values), group=info.group)
    return [v for part in out for v in part]


def gather_counts(value: int, info: DistInfo) -> list[int]:
    """Every rank's `value`, in rank order, in one all-gather."""
    if not info.active:
        return [int(value)]
    device = info.device if info.device.startswith("cuda") else "cpu"  # NCCL gathers CUDA tensors only
    parts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(info.world)]
    dist.all_gather(parts, torch.tensor([int(value)], dtype=torch.int64, device=device), group=info.group)
    return [int(p.item()) for p in parts]


def rank_max(values: list[int], info: DistInfo) -> list[int]:
    """Each value's maximum over the ranks, in one all-reduce: how the ranks agree on decisions such as stopping
    after this step (any rank's signal number) or writing a checkpoint now (rank 0's 0/1)."""
    if not info.active:
        return [int(v) for v in values]
    device = info.device if info.device.startswith("cuda") else "cpu"  # NCCL reduces CUDA tensors only
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=info.group)
    return [int(v) for v in t.tolist()]


def reduce_metrics(metrics: dict[str, float], info: DistInfo) -> dict[str, float]:
    """Mean of every numeric metric over the ranks that logged it (a rank that trained nothing this step, e.g. one
    holding only padding under dynamic sampling, logs no loss; the others' mean is the step's)."""
    if not info.active:
        return metrics
    mine = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    keys = sorted(set(gather_lists(mine, info)))
    logged = set(mine)
    values = torch.tensor([[float(metrics[k]), 1.0] if k in logged else [0.0, 0.0] for k in keys],
                          dtype=torch.float64).reshape(-1, 2)
    dist.all_reduce(values, group=info.group)
    return {**metrics, **{k: total / count for k, (total, count) in zip(keys, values.tolist(), strict=True)}}


class TrainingForward(nn.Module):
    """The training forward as one module call, so that DDP and FSDP2 see (and synchronise) it."""

    def __init__(self, policy: Policy):
        super().__init__()
        self.model = policy.model
        self._policy = policy

    def forward(self, prompts, prompt_index: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                temperature: float, **kwargs) -> CompletionOutput:
        return sequence_logprobs(self._policy, prompts, prompt_index, completion_ids, completion_mask, temperature,
                                 **kwargs)


def wrap(policy: Policy, info: DistInfo) -> nn.Module:
    """TrainingForward, wrapped in DDP or sharded with FSDP2 (each transformer block, then the root)."""
    module = TrainingForward(policy)
    if not info.active:
        return module
    if info.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # text-only batches leave the vision tower unused: let DDP tolerate unused parameters
        return DistributedDataParallel(module, find_unused_parameters=True, process_group=info.group)
    if info.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        # one FSDP unit per transformer block, found by the model's own `_no_split_modules` (the classes HF
        # never splits: decoder layers and vision blocks), for every family; the rest goes to the root unit
        block_classes = set(getattr(policy.model, "_no_split_modules", None) or [])
        blocks = [m for m in policy.model.modules() if type(m).__name__ in block_classes]
        if not blocks:
            raise ConfigError(f"fsdp2: {type(policy.model).__name__} names no transformer blocks (_no_split_modules)")
        mesh = None  # the default group's ranks; with rollout ranks, the training ranks' group
        if info.group is not None:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(info.group, "cuda" if info.device.startswith("cuda") else "cpu")
        for block in blocks:
            fully_shard(block, mesh=mesh)
        policy.family.dummy_vision = dummy_image_batch(policy)
        fully_shard(module, mesh=mesh)
        # Generation calls submodules directly, before any root forward; FSDP2 must know the root first, which
        # it learns in its (private) lazy init, normally run by the root's first forward.
        module._get_fsdp_state()._lazy_init()
        return module
    raise ValueError(f"trainer.distributed must be 'none', 'ddp' or 'fsdp2', got {info.mode!r}")


def dummy_image_batch(policy: Policy):
    """One blank image through the policy's own processor: what text-only forwards run the vision tower on under
    FSDP2 (see VLFamily.zero_vision_term)."""
    from PIL import Image

    return policy.processor([""], [[Image.new("RGB", (56, 56))]], ["fsdp2-vision-dummy"])


@contextlib.contextmanager
def gathered(module: nn.Module):
    """Full parameters for code that calls submodules directly (generation, evaluation, saving): every FSDP2 unit
    is unsharded once and kept so until the block ends. A no-op for DDP and single-process runs."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.set_reshard_after_forward(False)
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(True)


def full_parameters(policy: Policy, module: nn.Module):
    """The policy's parameters in order, each whole (FSDP2: gathered by every rank, which must all iterate), for
    handing the weights to a sampler: a copy, an engine, a rollout rank."""
    with torch.no_grad(), gathered(module):
        for p in policy.model.parameters():
            yield p.full_tensor() if hasattr(p, "full_tensor") else p


def no_sync(module: nn.Module, last: bool):
    """DDP: skip the gradient all-reduce on all but the last micro-batch of a minibatch."""
    if hasattr(module, "no_sync") and not last:
        return module.no_sync()
    return contextlib.nullcontext()


def full_state_dict(module: nn.Module, info: DistInfo) -> dict | None:
    """The policy's full (consolidated) state dict, on CPU, for saving a `from_pretrained` folder (FSDP2 gathers the
    shards: every rank must call this)."""
    if info.mode != "fsdp2" or not info.active:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    inner = module.model if isinstance(module, TrainingForward) else module
    return get_model_state_dict(inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def barrier(info: DistInfo) -> None:
    if info.active:
        dist.barrier(group=info.group)


def broadcast_object(obj, info: DistInfo):
    """rank 0's `obj` on every rank (e.g. the run directory rank 0 created)."""
    if not info.active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=info.group)
    return box[0]


class NullLogger:
    """What ranks other than 0 log to."""

    def log(self, *args, **kwargs) -> None: ...
    def log_rollouts(self, *args, **kwargs) -> None: ...
    def close(self) -> None: ...


def save_sharded_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, path, group=None) -> None:
    """FSDP2: each rank writes its shard of the optimizer state (torch.distributed.checkpoint); the consolidated
    model goes to the `from_pretrained` folder beside it. Call it only once the optimizer has state: on an empty
    optimizer, torch's state-dict helper initialises the state with a zero-lr step, which advances Adam's step
    counter and changes every later update."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optimizer": get_optimizer_state_dict(module, optimizer)}, checkpoint_id=str(path),
             process_group=group)


def load_sharded_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, path, group=None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(module, optimizer)}
    dcp.load(state, checkpoint_id=str(path), process_group=group)
    set_optimizer_state_dict(module, optimizer, state["optimizer"])
