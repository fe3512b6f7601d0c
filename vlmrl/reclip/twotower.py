"""The interface every ReCLIP two-tower student implements (`TwoTower`) and the file that marks a saved student's
folder (`MARKER`). The students themselves (`students.py`: Hugging Face CLIP/SigLIP; `embedded.py`: the embedded
real-tower student) build on this module, so neither needs the other to define itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image
from torch import nn

MARKER = "reclip_student.json"


class TwoTower(nn.Module):
    """Interface shared by every student (see the module docstring of `vlmrl.reclip.students`)."""

    kind = "base"
    trim_text_rows = False  # text input rows may be cut to their attention mask and zero-padded back when stacked

    def image_inputs(self, images: Sequence[Image.Image]) -> torch.Tensor:
        raise NotImplementedError

    def text_inputs(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def embed_images(self, inputs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def embed_texts(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    @property
    def logit_scale(self) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def encode_image(self, images: Sequence[Image.Image], batch_size: int = 64) -> torch.Tensor:
        """L2-normalised image embeddings [N, d]."""
        chunks = [self.embed_images(self.image_inputs(images[i:i + batch_size]))
                  for i in range(0, len(images), batch_size)]
        return torch.cat(chunks)

    @torch.no_grad()
    def encode_text(self, texts: Sequence[str], batch_size: int = 256) -> torch.Tensor:
        """L2-normalised text embeddings [N, d]."""
        chunks = [self.embed_texts(self.text_inputs(list(texts[i:i + batch_size])))
                  for i in range(0, len(texts), batch_size)]
        return torch.cat(chunks)

    def shard_units(self) -> list[nn.Module]:
        """The trainable blocks FSDP2 shards (`trainer.distributed=fsdp2`), each called through its own forward;
        every other parameter stays whole on each rank (vlmrl.reclip.parallel)."""
        return []

    def save_pretrained(self, path: str | Path, state_dict: dict | None = None) -> Path:
        """A loadable folder; `state_dict` (the student's own names) instead of the module's weights."""
        raise NotImplementedError
