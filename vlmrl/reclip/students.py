"""Two-tower students: one interface for Hugging Face CLIP/SigLIP models and the embedded real-tower student.

A student splits each tower into a frozen, cacheable *input* stage and a trainable *embed* stage:

    image_inputs(images) -> tensor        (preprocessing, plus any frozen tower prefix; no gradient)
    embed_images(inputs) -> [B, d]        (the trainable rest; L2-normalised)
    text_inputs(texts)   -> dict of [B, L] tensors, padded to a fixed length so cached rows stack
    embed_texts(inputs)  -> [B, d]

so the trainer computes the frozen part once per item. `encode_image` / `encode_text` chain the two for users.
`logit_scale` is the log of the similarity scale (CLIP's convention): logits = exp(logit_scale) * cos.

A saved student is a folder with `reclip_student.json` (its kind) beside the weights; `load_student` reads any of them.
HF students are ordinary `save_pretrained` folders, so `CLIPModel.from_pretrained(folder)` loads them too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from vlmrl.reclip.twotower import MARKER, TwoTower  # re-exported: the interface every student implements


class HFTwoTower(TwoTower):
    """A Hugging Face `CLIPModel` or `SiglipModel` with its tokenizer and image processor; both towers trainable."""

    kind = "hf"

    def __init__(self, model: nn.Module, tokenizer, image_processor, max_text_length: int = 32):
        super().__init__()
        self.model, self.tokenizer, self.image_processor = model, tokenizer, image_processor
        self.is_siglip = model.config.model_type == "siglip"
        limit = model.config.text_config.max_position_embeddings
        self.max_text_length = min(max_text_length, limit)

    def image_inputs(self, images: Sequence[Image.Image]) -> torch.Tensor:
        return self.image_processor([im.convert("RGB") for im in images], return_tensors="pt")["pixel_values"]

    def text_inputs(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        batch = self.tokenizer(list(texts), padding="max_length", truncation=True, max_length=self.max_text_length,
                               return_tensors="pt")
        out = {"input_ids": batch["input_ids"]}
        if "attention_mask" in batch and not self.is_siglip:  # SigLIP is trained without a padding mask
            out["attention_mask"] = batch["attention_mask"]
        return out

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def embed_images(self, inputs: torch.Tensor) -> torch.Tensor:
        out = self.model.get_image_features(pixel_values=inputs.to(self._device()))
        return F.normalize(_pooled(out), dim=-1)

    def embed_texts(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.model.get_text_features(**{k: v.to(self._device()) for k, v in inputs.items()})
        return F.normalize(_pooled(out), dim=-1)

    @property
    def logit_scale(self) -> torch.Tensor:
        return self.model.logit_scale.reshape(())

    def shard_units(self) -> list[nn.Module]:
        """The towers' transformer layers (the classes HF never splits, `_no_split_modules`) that train."""
        names = set(getattr(self.model, "_no_split_modules", None) or [])
        return [m for m in self.model.modules() if type(m).__name__ in names
                and any(p.requires_grad for p in m.parameters())]

    def save_pretrained(self, path: str | Path, state_dict: dict | None = None) -> Path:
        """`save_pretrained` of the model, tokenizer and image processor; `state_dict` (the student's names,
        "model." first) instead of the module's own, e.g. the whole tensors of a sharded student."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        weights = None if state_dict is None else {k.removeprefix("model."): v for k, v in state_dict.items()}
        self.model.save_pretrained(path, state_dict=weights)
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)
        (path / MARKER).write_text(json.dumps({"kind": self.kind, "max_text_length": self.max_text_length}))
        return path


def _pooled(out: Any) -> torch.Tensor:
    """transformers 5 returns a model output whose pooler_output holds the projected features; 4.x a tensor."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def word_tokenizer(texts: Sequence[str]):
    """A lower-cased word-level tokenizer over `texts` with [PAD]=0, [BOS], [EOS], [UNK]; each text is wrapped in
    [BOS] ... [EOS] (CLIP pools the [EOS] position). For students built from a config, with no tokenizer of their own."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(list(texts), trainers.WordLevelTrainer(
        special_tokens=["[PAD]", "[BOS]", "[EOS]", "[UNK]"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A [EOS]",
                                                       special_tokens=[("[BOS]", 1), ("[EOS]", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]",
                                   unk_token="[UNK]")


def hf_student_from_config(config: dict, texts: Sequence[str], seed: int = 0, image_size: int = 0,
                           max_text_length: int = 32) -> HFTwoTower:
    """A randomly initialised CLIPModel / SiglipModel from a config dict (`model_type`: clip or siglip, plus
    `text_config`, `vision_config`, ...) with a word-level tokenizer trained on `texts`; for tests and experiments."""
    from transformers import CLIPConfig, CLIPModel, SiglipConfig, SiglipModel

    config = dict(config)
    model_type = config.pop("model_type", "clip")
    if model_type not in ("clip", "siglip"):
        raise ValueError(f"student.config.model_type must be 'clip' or 'siglip', got {model_type!r}")
    tokenizer = word_tokenizer(texts)
    text_config = {**config.pop("text_config", {}), "vocab_size": len(tokenizer), "pad_token_id": 0,
                   "bos_token_id": 1, "eos_token_id": 2}
    text_config.setdefault("max_position_embeddings", max_text_length)
    vision_config = dict(config.pop("vision_config", {}))
    side = image_size or vision_config.get("image_size", 224)
    vision_config["image_size"] = side
    config_cls, model_cls = (CLIPConfig, CLIPModel) if model_type == "clip" else (SiglipConfig, SiglipModel)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config_cls(text_config=text_config, vision_config=vision_config, **config))
    return HFTwoTower(model, tokenizer, _image_processor(model_type, side), max_text_length)


def _image_processor(model_type: str, side: int):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    if model_type == "clip":
        return CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return SiglipImageProcessorPil(size={"height": side, "width": side})


def load_hf_student(name_or_path: str | Path, max_text_length: int = 32) -> HFTwoTower:
    """Any `CLIPModel` / `SiglipModel` from the hub or a folder, with its tokenizer and image processor."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, CLIPModel, SiglipModel

    config = AutoConfig.from_pretrained(name_or_path)
    if config.model_type not in ("clip", "siglip"):
        raise ValueError(f"{name_or_path}: model_type {config.model_type!r} is not a two-tower model; "
                         "ReCLIP students are CLIPModel or SiglipModel checkpoints, or 'embedded'")
    model_cls = CLIPModel if config.model_type == "clip" else SiglipModel
    model = model_cls.from_pretrained(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    image_processor = AutoImageProcessor.from_pretrained(name_or_path)
    marker = Path(name_or_path) / MARKER
    if marker.exists():
        max_text_length = json.loads(marker.read_text()).get("max_text_length", max_text_length)
    return HFTwoTower(model, tokenizer, image_processor, max_text_length)


def load_student(path: str | Path) -> TwoTower:
    """A saved student folder (any kind), or a CLIP/SigLIP hub name or folder. For users: the result has
    `encode_text(list[str])` and `encode_image(list[PIL.Image])`, returning L2-normalised embeddings."""
    marker = Path(path) / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("kind") == "embedded":
        from vlmrl.reclip.embedded import EmbeddedStudent

        return EmbeddedStudent.from_pretrained(path)
    return load_hf_student(path)
