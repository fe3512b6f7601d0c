"""Load a policy: any supported Hugging Face VLM by hub name or folder, the embedded tiny model and LoRA adapter
checkpoints included."""

from __future__ import annotations

import copy
import json
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from vlmrl.errors import PathError
from vlmrl.models.families import FAMILIES, VLFamily, VLProcessor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ADAPTER_CONFIG = "adapter_config.json"


@dataclass
class Policy:
    """A VLM with the one processor that feeds both generation and training.

    Under LoRA `model` is the PEFT wrapper (adapters injected in place, so `family` — which holds the transformers
    model inside — runs with them) and `base_model` is the folder or hub name of the weights the adapters sit on.
    """

    model: torch.nn.Module
    processor: VLProcessor
    family: VLFamily
    eos_token_ids: list[int]  # the end-of-turn token first (SFT targets end with it)
    pad_token_id: int
    base_model: str | None = None

    @property
    def has_adapters(self) -> bool:
        return hasattr(self.model, "disable_adapter")

    @contextmanager
    def sampling(self) -> Iterator[None]:
        """The model in eval mode (dropout off) inside, its mode restored after. Nested uses toggle nothing: an RL step
        enters once around all its generation calls (setting the mode walks every module)."""
        training = self.model.training
        if training:
            self.model.eval()
        try:
            yield
        finally:
            if training:
                self.model.train()

    def with_model(self, model: torch.nn.Module, **changes) -> Policy:
        """This policy around another model (e.g. merged adapters): a new family on it, with the same autocast
        setting, and the same processor and token ids."""
        family = type(self.family)(model)
        family.autocast_dtype = self.family.autocast_dtype
        return replace(self, model=model, family=family, **changes)

    def clone(self) -> Policy:
        """An independent copy of the weights (the frozen reference, a separate critic); the processor is shared."""
        return self.with_model(copy.deepcopy(self.model))

    def save_pretrained(self, path: str | Path) -> None:
        """A folder `load_policy` reads back: the full model, or under LoRA the adapters plus a pointer to the base
        (relative when the base is a local folder, so a run directory can move)."""
        path = Path(path)
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)
        if self.has_adapters and self.base_model is not None:
            cfg_file = path / ADAPTER_CONFIG
            cfg = json.loads(cfg_file.read_text())
            base = Path(self.base_model)
            cfg["base_model_name_or_path"] = os.path.relpath(base.resolve(), path.resolve()) if base.is_dir() \
                else self.base_model
            cfg_file.write_text(json.dumps(cfg, indent=2))


def adapter_base(path: str | Path) -> str | None:
    """The base model of a LoRA adapter folder (resolved against the folder), or None if `path` holds no adapters."""
    cfg_file = Path(path) / ADAPTER_CONFIG
    if not cfg_file.is_file():
        return None
    base = json.loads(cfg_file.read_text()).get("base_model_name_or_path")
    if not base:
        raise PathError(f"{cfg_file}: no base_model_name_or_path; cannot tell which weights the adapters belong to")
    local = Path(path) / base
    return str(local.resolve()) if local.is_dir() else base


def end_token_ids(processor: VLProcessor, model) -> list[int]:
    """Generation stops at these: the family's end-of-turn tokens (first), the tokenizer's and the model's eos."""
    tok = processor.tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in processor.end_tokens if t in tok.get_vocab()]
    gen = getattr(model.generation_config, "eos_token_id", None)
    ids += [tok.eos_token_id] + (gen if isinstance(gen, list) else [gen])
    return list(dict.fromkeys(i for i in ids if i is not None))


def load_policy(name_or_path: str | Path, dtype: str = "float32", device: str = "cpu",
                min_pixels: int | None = None, max_pixels: int | None = None, autocast: bool = True) -> Policy:
    """Load model + processor from a hub name or a folder written by `save_pretrained` (our checkpoints included; a
    LoRA checkpoint loads its base and applies the adapters, trainable).

    `autocast`: on CUDA, forwards run under bf16 autocast (weights stay in `dtype`); on CPU everything is `dtype`.
    """
    from transformers import AutoConfig, AutoModelForImageTextToText

    base = adapter_base(name_or_path)
    weights = base or name_or_path
    config = AutoConfig.from_pretrained(weights)
    if config.model_type not in FAMILIES:
        raise PathError(f"model {weights!r} has model_type {config.model_type!r}; supported families: "
                         f"{sorted(FAMILIES)} (docs/models.md: adding a family)")
    processor_cls, family_cls = FAMILIES[config.model_type]
    model = AutoModelForImageTextToText.from_pretrained(weights, dtype=DTYPES[dtype]).to(device)
    processor = processor_cls.from_pretrained(name_or_path, config=config)
    processor.set_pixel_budget(min_pixels, max_pixels)
    eos = end_token_ids(processor, model)
    family = family_cls(model)
    if not autocast:
        family.autocast_dtype = None
    if base is not None:
        from peft import PeftModel

        with warnings.catch_warnings():  # PEFT calls a transformers method deprecated in 5.x
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = PeftModel.from_pretrained(model, str(name_or_path), is_trainable=True)
        for config in model.peft_config.values():  # resolved, so PEFT's own checks on save find the base
            config.base_model_name_or_path = base
    return Policy(model, processor, family, eos, processor.tokenizer.pad_token_id, base)
