"""Load a policy: any supported Hugging Face VLM by hub name or folder, the embedded tiny model included."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vlmrl.models.qwen_vl import QwenVLFamily, QwenVLProcessor

# model_type -> (processor class, model-side family hooks). Adding a family is one entry and one small module.
FAMILIES = {
    "qwen2_vl": (QwenVLProcessor, QwenVLFamily),
    "qwen2_5_vl": (QwenVLProcessor, QwenVLFamily),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Policy:
    """A VLM with the one processor that feeds both generation and training."""

    model: torch.nn.Module
    processor: QwenVLProcessor
    family: QwenVLFamily
    eos_token_ids: list[int]
    pad_token_id: int

    def save_pretrained(self, path: str | Path) -> None:
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)


def load_policy(name_or_path: str | Path, dtype: str = "float32", device: str = "cpu",
                min_pixels: int | None = None, max_pixels: int | None = None) -> Policy:
    """Load model + processor from a hub name or a folder written by `save_pretrained` (our checkpoints included)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(name_or_path)
    if config.model_type not in FAMILIES:
        raise ValueError(f"model {name_or_path!r} has model_type {config.model_type!r}; supported families: "
                         f"{sorted(FAMILIES)}")
    processor_cls, family_cls = FAMILIES[config.model_type]
    model = AutoModelForImageTextToText.from_pretrained(name_or_path, dtype=DTYPES[dtype]).to(device)
    processor = processor_cls.from_pretrained(name_or_path)
    processor.set_pixel_budget(min_pixels, max_pixels)
    tok = processor.tokenizer
    eos = {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    eos.discard(None)
    return Policy(model, processor, family_cls(model), sorted(eos), tok.pad_token_id)
