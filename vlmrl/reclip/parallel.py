"""ReCLIP across processes: `torchrun --nproc_per_node N -m vlmrl reclip train ... trainer.distributed=ddp`.

Every rank draws the same global batch and the same candidate stream; each embeds a contiguous share of the batch's
rows (images, captions, hard negatives, memory-bank items), and the shares are all-gathered *with their gradients*
(as open_clip's `gather_with_grad`), so the retrieval pool is the global batch on every rank. A rank judges and takes
the loss of its own share of the queries only, normalised by the global batch; the gather's backward sends every
rank's loss gradient to the rank that embedded the row, and the parameter gradients are summed across ranks before
the clip and the optimizer step (data parallel, as DDP does). The update therefore equals the single-process one
within float rounding (the ranks embed in other batch shapes, so similarities differ in their last bits: a top-k pick
between two candidates that tie within rounding may go the other way; sampled picks do not flip). Judgements are memoised on each rank and every step's new ones are shared with all ranks;
held-out evaluation, logs and saved students are rank 0's.

`trainer.distributed=fsdp2` is the same with the student's trainable blocks (`TwoTower.shard_units`: MBConv blocks
and BERT layers, a CLIP's or SigLIP's transformer layers) sharded by FSDP2's `fully_shard`: each rank holds a 1/world
slice of their weights, gradients and Adam moments, the blocks' weights are gathered for each forward, and their
gradients reduce-scattered (FSDP2's mean, times the number of ranks: each rank's loss is already its share of the
global batch's, so the gradient is the sum). The rest (heads, scale, frozen prefix) stays whole on every rank and is
summed as under ddp. The gradient norm is the whole gradient's (sharded squares summed over the ranks), so clipping
and the step equal ddp's. Held-out evaluation, saved students and checkpoints gather the blocks whole first (every
rank takes part).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

from vlmrl.trainer.distributed import DistInfo, all_sum, gather_lists


@dataclass(frozen=True)
class Parallel:
    """This process's place among the ranks (one process: rank 0 of 1, and every method is the identity)."""

    info: DistInfo

    @property
    def world(self) -> int:
        return self.info.world

    @property
    def rank(self) -> int:
        return self.info.rank

    def rows(self, n: int) -> tuple[int, int]:
        """[start, stop) of this rank's share of n rows: contiguous chunks of ceil(n / world), the last shorter."""
        per = -(-n // self.world)
        return min(n, self.rank * per), min(n, (self.rank + 1) * per)

    def embed(self, fn: Callable[[list], torch.Tensor], rows: list, grad: bool = True) -> torch.Tensor:
        """fn(rows) for all rows, computed a share per rank and gathered in row order ([len(rows), d] on every rank).
        With `grad`, gradients flow back to the rank that embedded each row."""
        if self.world == 1:
            return fn(rows)
        per = -(-len(rows) // self.world)
        start, stop = self.rows(len(rows))
        mine = rows[start:stop] or rows[-1:]  # a rank without rows embeds a stand-in row, dropped below
        out = fn(mine)
        if len(mine) < per:  # all_gather needs equal shapes: pad with copies of the last row (sliced away)
            out = torch.cat([out, out[-1:].expand(per - len(mine), *out.shape[1:])])
        if grad:
            parts = dist_nn.all_gather(out, group=self.info.group)
        else:
            parts = [torch.empty_like(out) for _ in range(self.world)]
            dist.all_gather(parts, out.detach().contiguous(), group=self.info.group)
        gathered = []
        for rank, part in enumerate(parts):
            lo, hi = min(len(rows), rank * per), min(len(rows), (rank + 1) * per)
            gathered.append(part[:hi - lo])
        return torch.cat(gathered)

    @property
    def sharded(self) -> bool:
        return self.info.mode == "fsdp2" and self.world > 1

    def shard(self, student) -> None:
        """FSDP2 over `student.shard_units()` (fsdp2 only; see the module docstring)."""
        if not self.sharded:
            return
        from torch.distributed.fsdp import fully_shard

        units = student.shard_units()
        if not units:
            from vlmrl.errors import ConfigError

            raise ConfigError(f"trainer.distributed=fsdp2: the {student.kind} student has no trainable blocks to shard "
                              "(its towers are frozen); use trainer.distributed=ddp")
        mesh = self._mesh()
        for unit in units:
            fully_shard(unit, mesh=mesh)

    def full_state_dict(self, module: torch.nn.Module) -> dict | None:
        """fsdp2: `module`'s weights whole, on CPU (every rank must call); otherwise None (its own will do)."""
        if not self.sharded:
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _mesh(self):
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        kind = "cuda" if str(self.info.device).startswith("cuda") else "cpu"
        if self.info.group is not None:
            return DeviceMesh.from_group(self.info.group, kind)
        return init_device_mesh(kind, (self.world,))

    def clip_gradients(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """torch.nn.utils.clip_grad_norm_'s clip by the whole gradient's norm, for whole and sharded gradients alike
        (a sharded one's squares are summed over the ranks); returns that norm."""
        if not self.sharded:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        grads = [p.grad for p in params if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        shard_sq = sum((g.float().pow(2).sum() for g, d in zip(local, grads, strict=True) if hasattr(d, "to_local")),
                       torch.zeros((), device=local[0].device if local else "cpu"))
        dist.all_reduce(shard_sq, group=self.info.group)
        whole_sq = sum((g.float().pow(2).sum() for g, d in zip(local, grads, strict=True) if not hasattr(d, "to_local")),
                       torch.zeros_like(shard_sq))
        norm = (shard_sq + whole_sq).sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in local:
            g.mul_(coef.to(g.dtype))
        return float(norm)

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank."""
        if self.world > 1:
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0, group=self.info.group)

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Each whole parameter's gradient summed over the ranks (one flat all-reduce); a sharded one's FSDP2 has
        reduce-scattered in the backward already, as a mean (gloo has no pre-scaled sum), made the sum here."""
        for p in params:
            if hasattr(p, "to_local") and p.grad is not None:
                p.grad.to_local().mul_(self.world)
        params = [p for p in params if not hasattr(p, "to_local")]
        if self.world == 1 or not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.info.group)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            p.grad = flat[offset:offset + g.numel()].view_as(g).clone()
            offset += g.numel()

    def share(self, entries: list) -> list:
        """Every rank's `entries` (picklable), joined in rank order."""
        return gather_lists(entries, self.info)

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Counts summed over the ranks (keys any rank has)."""
        if self.world == 1:
            return values
        keys = sorted(set(self.share(sorted(values))))
        totals = all_sum(torch.tensor([float(values.get(k, 0.0)) for k in keys], dtype=torch.float64), self.info)
        return dict(zip(keys, totals.tolist(), strict=True))

    def finish(self) -> None:
        """Every rank done (rank 0 has written its files), then leave the process group."""
        if self.world > 1 and dist.is_initialized():
            dist.barrier(group=self.info.group)
            dist.destroy_process_group()

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        """Means over the ranks (every rank holds a share of equal size, so the mean of means is the mean)."""
        if self.world == 1:
            return values
        return {k: v / self.world for k, v in self.sum(values).items()}


SINGLE = Parallel(DistInfo())
