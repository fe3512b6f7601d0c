"""Which weights train: full fine-tuning (optionally with the vision tower or the projector frozen) or LoRA adapters
through PEFT; gradient checkpointing; merging adapters back into a plain `from_pretrained` folder.

Parameter names are those of the transformers model (`model.language_model.layers.0.self_attn.q_proj.weight`); each
family names its decoder (`language_attr`), vision tower and projector prefixes, so these functions work for all.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from vlmrl.config import LoraConfig, ModelConfig
from vlmrl.errors import ConfigError
from vlmrl.models.families.base import unwrap_peft
from vlmrl.models.policy import Policy, load_policy


def _peft():
    try:
        import peft
    except ImportError as e:
        raise ImportError("model.lora needs PEFT: pip install 'vlmrl[lora]'") from e
    return peft


def freeze(policy: Policy, vision: bool = False, projector: bool = False) -> int:
    """Stop gradients to the vision tower (projector excluded) and/or the projector; returns the parameters frozen."""
    fam = policy.family
    frozen = 0
    for name, p in fam.model.named_parameters():
        in_projector = name.startswith(fam.projector_prefixes)
        in_vision = name.startswith(fam.vision_prefixes) and not in_projector
        if (vision and in_vision) or (projector and in_projector):
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


def enable_gradient_checkpointing(policy: Policy) -> None:
    """Recompute decoder-layer activations during backward (non-reentrant, so frozen inputs are fine)."""
    model = unwrap_peft(policy.model)
    if hasattr(model, "activation_checkpointing_enable"):  # the transformers >= 5.2x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def configure_training(policy: Policy, m: ModelConfig) -> Policy:
    """Apply model.freeze_vision / freeze_projector / gradient_checkpointing / image_cache_mb / vision_cache_mb
    (after loading, also on resume)."""
    policy.processor.image_cache.max_bytes = m.image_cache_mb * 2**20
    policy.family.vision_cache.max_bytes = m.vision_cache_mb * 2**20
    freeze(policy, m.freeze_vision, m.freeze_projector)
    if m.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    return policy


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout rate to 0: `nn.Dropout` modules (LoRA's adapter dropout included) and the float rates that
    attention layers read at call time. RL compares log-probs of one weights across passes (old, reference, training
    forward); dropout in some of them would make the first ratio differ from 1 and the KL noisy. Returns the count."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.p = 0.0
            changed += 1
        for attr in ("attention_dropout", "dropout", "hidden_dropout", "activation_dropout"):
            value = getattr(module, attr, None)
            if isinstance(value, float) and value > 0:
                setattr(module, attr, 0.0)
                changed += 1
    return changed


def lora_targets(policy: Policy, cfg: LoraConfig) -> list[str]:
    """Full names of the linear layers to adapt: those of the decoder (and of the vision tower with include_vision,
    projector excluded) whose last name part is in `cfg.target_modules` (all linear layers when it is null)."""
    fam = policy.family
    prefixes = (f"model.{fam.language_attr}.",) + (fam.vision_prefixes if cfg.include_vision else ())
    candidates = [name for name, module in fam.model.named_modules()
                  if isinstance(module, torch.nn.Linear) and name.startswith(prefixes)
                  and not name.startswith(fam.projector_prefixes)]
    names = [n for n in candidates if cfg.target_modules is None or n.rsplit(".", 1)[-1] in cfg.target_modules]
    if not names:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in candidates})
        raise ConfigError(f"model.lora.target_modules={cfg.target_modules}: no linear layer of this "
                         f"{type(fam.model).__name__} matches; the adaptable layers are named {leaves}")
    return names


def add_lora(policy: Policy, cfg: LoraConfig, base_model: str | Path) -> Policy:
    """Wrap the policy's model with fresh LoRA adapters (B = 0, so the policy is unchanged) on the weights stored at
    `base_model`; only the adapters train. Returns the same Policy, its `model` now the PEFT wrapper."""
    peft = _peft()
    config = peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha if cfg.alpha is not None else 2 * cfg.r,
                             lora_dropout=cfg.dropout, target_modules=lora_targets(policy, cfg), bias="none")
    with warnings.catch_warnings():  # PEFT calls a transformers method deprecated in 5.x
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        policy.model = peft.get_peft_model(policy.model, config)
    policy.model.peft_config["default"].base_model_name_or_path = str(base_model)
    policy.base_model = str(base_model)
    return policy


def start_lora(policy: Policy, m: ModelConfig, save_base_to: str | Path | None = None, save: bool = True) -> Policy:
    """Before RL: add adapters when model.lora.r > 0. `save_base_to`: where the current weights go first (when SFT
    changed them), so adapter checkpoints point at the weights they were trained on; `save`: False on ranks other
    than the main one (they only point there)."""
    if m.lora.r <= 0 or policy.has_adapters:
        return policy
    if save_base_to is not None:
        if save:
            policy.save_pretrained(save_base_to)
        base = save_base_to
    else:
        base = policy.family.model.name_or_path
    policy = add_lora(policy, m.lora, base)
    if m.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    return policy


def merge_lora(policy: Policy) -> Policy:
    """The same policy with its adapters merged into the weights (W + alpha/r * B A) and the PEFT wrapper removed."""
    if not policy.has_adapters:
        return policy
    return policy.with_model(policy.model.merge_and_unload(), base_model=None)


def merge_checkpoint(checkpoint: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write `out/`: the adapters of `checkpoint` merged into their base, a plain folder that `from_pretrained` and
    `load_policy` read without PEFT. A checkpoint without adapters is copied as is (re-saved)."""
    policy = merge_lora(load_policy(checkpoint, dtype))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(out)
    return out


def parameter_counts(policy: Policy) -> dict[str, int]:
    """Trainable and total parameters (adapters included)."""
    params = list(policy.model.parameters())
    return {"params/trainable": sum(p.numel() for p in params if p.requires_grad),
            "params/total": sum(p.numel() for p in params)}
