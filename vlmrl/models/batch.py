"""The two tensors bundles every model family shares: processed prompts (`PromptBatch`) and their embeddings
(`PromptEmbeds`). Families differ in what their image tensors look like, so the images of a batch are a dict of
tensors (`vision`) with, per key, the rows each image occupies: selecting or concatenating prompts never needs to
know which family produced them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from vlmrl.errors import DataError


class PromptTooLongError(DataError):
    """A prompt (image placeholders included) is longer than `data.max_prompt_length`. Prompts are never truncated:
    a cut inside an image placeholder span would misalign image features and tokens."""


@dataclass
class PromptBatch:
    """Processed prompts, left-padded. Row p holds prompt p; `vision` holds the images of all prompts, in order.

    `vision[key]` stacks the image tensors of every image along dim 0, image i taking `vision_rows[key][i]` rows
    (Qwen's `pixel_values`: one row per patch; `image_grid_thw`: one row per image; Idefics3: one row per tile).
    """

    sample_ids: list[str]
    input_ids: Tensor  # [P, L]
    attention_mask: Tensor  # [P, L]
    mm_token_type_ids: Tensor  # [P, L] 1 on the placeholder tokens that image features replace
    vision: dict[str, Tensor] = field(default_factory=dict)
    vision_rows: dict[str, list[int]] = field(default_factory=dict)
    images_per_prompt: list[int] = field(default_factory=list)
    image_tokens: list[int] = field(default_factory=list)  # placeholder tokens (= features) of each image
    image_keys: list[int | None] = field(default_factory=list)  # each image's processor-cache serial (or None)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def pixel_values(self) -> Tensor | None:
        return self.vision.get("pixel_values")

    @property
    def image_grid_thw(self) -> Tensor | None:
        return self.vision.get("image_grid_thw")

    def image_range(self, prompts: list[int]) -> list[int]:
        """Indices (into all images of the batch) of the images of `prompts`, in order."""
        start = [0]
        for n in self.images_per_prompt:
            start.append(start[-1] + n)
        return [i for p in prompts for i in range(start[p], start[p + 1])]

    def keys_of_images(self) -> list[int | None]:
        """`image_keys`, one per image (None where a batch was built without them)."""
        return self.image_keys or [None] * len(self.image_tokens)

    def select_images(self, images: list[int]) -> tuple[dict[str, Tensor], dict[str, list[int]]]:
        """(vision, vision_rows) of the images at positions `images` (into all images of the batch), in order."""
        vision, vision_rows = {}, {}
        if images:
            for key, tensor in self.vision.items():
                sizes = self.vision_rows[key]
                start = [0]
                for s in sizes:
                    start.append(start[-1] + s)
                vision[key] = torch.cat([tensor[start[i]:start[i + 1]] for i in images])
                vision_rows[key] = [sizes[i] for i in images]
        return vision, vision_rows

    def subset(self, prompts: list[int]) -> PromptBatch:
        """The prompts at positions `prompts` (their images too), with left padding common to all rows removed."""
        rows = torch.tensor(prompts, dtype=torch.long)
        mask = self.attention_mask[rows]
        first = int((mask.cumsum(-1) == 0).sum(-1).min())  # columns that are padding in every kept row
        images = self.image_range(prompts)
        vision, vision_rows = self.select_images(images)
        keys = self.keys_of_images()
        return PromptBatch([self.sample_ids[p] for p in prompts], self.input_ids[rows, first:], mask[:, first:],
                           self.mm_token_type_ids[rows, first:], vision, vision_rows,
                           [self.images_per_prompt[p] for p in prompts], [self.image_tokens[i] for i in images],
                           [keys[i] for i in images])


@dataclass
class ConversationBatch(PromptBatch):
    """Whole multi-turn trajectories, one row each: the prompt, then every turn after it (the policy's tokens and the
    observations with their images, vlmrl.agent), left-padded like prompts. The last `completion_tokens[p]` columns
    of row p are what came after its prompt; they are the row's completion ids, in order, so the training forward
    runs the whole row once (every image span in place, positions from the family's own rule) and reads the
    completion's log-probs off its last columns (`vlmrl.models.forward.conversation_logprobs`)."""

    completion_tokens: list[int] = field(default_factory=list)

    def subset(self, prompts: list[int]) -> ConversationBatch:
        base = super().subset(prompts)
        return ConversationBatch(**vars(base), completion_tokens=[self.completion_tokens[p] for p in prompts])


def concat_prompt_batches(batches: list[PromptBatch], pad_token_id: int) -> PromptBatch:
    """One PromptBatch from several (rows in order), re-padded on the left to the longest prompt (a
    ConversationBatch when all of them are)."""
    width = max(b.input_ids.shape[1] for b in batches)

    def left_pad(x: Tensor, value: int) -> Tensor:
        return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

    keys = dict.fromkeys(k for b in batches for k in b.vision)
    vision = {k: torch.cat([b.vision[k] for b in batches if k in b.vision]) for k in keys}
    vision_rows = {k: [n for b in batches for n in b.vision_rows.get(k, [])] for k in keys}
    out = PromptBatch([i for b in batches for i in b.sample_ids],
                      torch.cat([left_pad(b.input_ids, pad_token_id) for b in batches]),
                      torch.cat([left_pad(b.attention_mask, 0) for b in batches]),
                      torch.cat([left_pad(b.mm_token_type_ids, 0) for b in batches]),
                      vision, vision_rows, [n for b in batches for n in b.images_per_prompt],
                      [n for b in batches for n in b.image_tokens], [k for b in batches for k in b.keys_of_images()])
    if all(isinstance(b, ConversationBatch) for b in batches):
        return ConversationBatch(**vars(out), completion_tokens=[n for b in batches for n in b.completion_tokens])
    return out


@dataclass
class PromptEmbeds:
    """Prompt input embeddings with image features in place, and their positions.

    `position_ids` is [3, P, L] for every family: Qwen's M-RoPE uses the three rows (temporal, height, width);
    families with 1-D positions keep three equal rows and read row 0. Completion token t of row p sits at position
    `next_position[p] + t` in every row. `extras` holds family-specific per-prompt tensors (rows on dim 0) that the
    language model needs over the prompt columns, e.g. Qwen3-VL's deepstack features or Gemma 3's image-token mask.
    """

    embeds: Tensor  # [P, L, H]
    attention_mask: Tensor  # [P, L]
    position_ids: Tensor  # [3, P, L]
    next_position: Tensor  # [P] position of the first completion token
    extras: dict[str, Tensor] = field(default_factory=dict)

    def select(self, index: Tensor) -> PromptEmbeds:
        """Rows `index` (e.g. each prompt repeated G times for its group), without recomputing anything.

        index_select rather than `x[index]`: both copy the same rows, but the backward of `x[index]` is
        index_put_(accumulate=True), which on a CPU with 2+ threads adds a repeated row's gradients with atomics in an
        order that depends on timing, so a run on a busy machine drifts from the same run on a quiet one;
        index_select's backward (index_add_) adds in index order."""
        pick = lambda x, dim=0: x.index_select(dim, index)  # noqa: E731
        return PromptEmbeds(pick(self.embeds), pick(self.attention_mask), pick(self.position_ids, 1),
                            pick(self.next_position), {k: pick(v) for k, v in self.extras.items()})

    def completion_positions(self, start: int, length: int) -> Tensor:
        """Positions [3, N, length] of completion tokens start .. start + length - 1."""
        offsets = torch.arange(start, start + length, device=self.next_position.device)
        n = self.next_position.shape[0]
        return (self.next_position[:, None] + offsets).unsqueeze(0).expand(3, n, length)
