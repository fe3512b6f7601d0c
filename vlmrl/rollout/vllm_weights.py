"""What a weight push hands vLLM (vlmrl.rollout.vllm_engine): every weight of the model under the base model's names,
LoRA layers merged out of place in float32.

Every weight, the frozen ones included: vLLM 0.32 and later reload a model layer by layer, rebuilding a layer from
what it is given, and a layer given only part of its weights keeps the rest uninitialised. vLLM fuses projections
that the Hugging Face model keeps apart (q, k and v in one `qkv_proj`, gate and up in one `gate_up_proj`), so a push
of the trainable weights only (LoRA on q_proj and v_proj, say) hands a fused layer two of its three parts: on the
real engine the sampler/trainer log-prob gap was 9.4 after such a push (tests/test_vllm_real.py). A push is an
in-process copy; its cost beside a step's generation is small (BENCHMARKS.md)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import Tensor, nn


def _hf_name(name: str) -> str:
    """A PEFT parameter name as the base model names it: `base_model.model.x.base_layer.weight` -> `x.weight`,
    `base_model.model.x.modules_to_save.default.weight` -> `x.weight`."""
    name = name.removeprefix("base_model.model.")
    return re.sub(r"\.(?:base_layer|modules_to_save\.[^.]+)(?=\.)", "", name)


def _is_lora_layer(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("base_layer", "lora_A", "lora_B", "scaling", "active_adapters"))


def _lora_delta(layer: nn.Module, weight: Tensor) -> Tensor | None:
    """sum over the layer's active adapters of scaling * B @ A (transposed for fan_in_fan_out), in float32; None when
    the adapters are disabled or none is on this layer."""
    if getattr(layer, "disable_adapters", False):
        return None
    if getattr(layer, "merged", False):
        raise RuntimeError("push_weights: a LoRA layer has its adapters merged into its base weight; the merged weight "
                           "is built out of place, the base must stay the unmerged one")
    delta = None
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        if getattr(layer, "use_dora", {}).get(name) or getattr(layer, "lora_bias", {}).get(name):
            raise NotImplementedError("push_weights merges plain LoRA only (no DoRA, no lora_bias)")
        d = (layer.lora_B[name].weight.float() @ layer.lora_A[name].weight.float()) * layer.scaling[name]
        d = d.T if getattr(layer, "fan_in_fan_out", False) else d
        delta = d.to(weight.device) if delta is None else delta + d.to(weight.device)
    return delta


@torch.no_grad()
def weights_to_push(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(base-model name, tensor) of every weight vLLM holds, one at a time: every LoRA layer's merged weight (W +
    delta computed in float32, cast to W's dtype; W itself untouched), then every other parameter, trainable or
    frozen (module docstring). Adapter parameters are never pushed."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    pushed = set()
    for module in model.modules():
        if not _is_lora_layer(module):
            continue
        weight = module.get_base_layer().weight if hasattr(module, "get_base_layer") else module.base_layer.weight
        delta = _lora_delta(module, weight)
        merged = weight.detach() if delta is None else (weight.float() + delta).to(weight.dtype)
        name = _hf_name(names[id(weight)])
        pushed.add(name)
        yield name, merged
    for name, p in model.named_parameters():
        if ".lora_" not in name and _hf_name(name) not in pushed:
            yield _hf_name(name), p.detach()
