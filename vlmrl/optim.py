"""The optimizer every vlmrl trainer uses: AdamW, with the multi-tensor (foreach) kernels on every device.

PyTorch picks the foreach implementation by default only on CUDA; on CPU it loops over the parameters one tensor at a
time, a dozen small ops each. The foreach path computes the same update (identical weights, step after step: see
tests/test_optim.py) with a few ops per step for the whole model, which matters for the small models a CPU run trains.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float = 0.01) -> torch.optim.AdamW:
    """torch.optim.AdamW over `params` (its default weight decay, 0.01, unless given), foreach on every device."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)
