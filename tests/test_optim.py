"""vlmrl's AdamW (vlmrl/optim.py) takes torch's foreach path on CPU and gives exactly the weights the default
one-tensor-at-a-time loop gives, so switching it on changed no trained number."""

import torch

from vlmrl.optim import adamw


def test_foreach_adamw_steps_to_the_same_weights_as_the_single_tensor_loop():
    torch.manual_seed(0)
    shapes = [(516, 96), (288, 96), (96,), (256, 96), (96, 256), (1176, 96)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    loop = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = adamw(ours, 3e-4, weight_decay=0.05)
    reference = torch.optim.AdamW(loop, lr=3e-4, weight_decay=0.05, foreach=False)
    assert opt.defaults["foreach"] is True
    moved = [p.detach().clone() for p in ours]
    for _ in range(30):
        grads = [torch.randn(s) * 10 for s in shapes]
        for params, optimizer in ((ours, opt), (loop, reference)):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            optimizer.step()
    assert max((a - b).abs().max().item() for a, b in zip(ours, moved, strict=True)) > 1e-3  # the steps moved them
    for a, b in zip(ours, loop, strict=True):
        assert torch.equal(a, b)


def test_default_weight_decay_is_torchs():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert adamw(p, 1e-3).defaults["weight_decay"] == torch.optim.AdamW(p, lr=1e-3).defaults["weight_decay"]
