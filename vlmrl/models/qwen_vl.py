"""Compatibility module: the Qwen-VL family moved to `vlmrl.models.families.qwen_vl`, the shared prompt containers to
`vlmrl.models.batch`. Existing imports keep working."""

from vlmrl.models.batch import PromptBatch, PromptEmbeds, PromptTooLongError, concat_prompt_batches
from vlmrl.models.families.qwen_vl import IMAGE_PAD, VISION_BLOCK, Qwen3VLFamily, QwenVLFamily, QwenVLProcessor

__all__ = ["IMAGE_PAD", "VISION_BLOCK", "PromptBatch", "PromptEmbeds", "PromptTooLongError", "Qwen3VLFamily",
           "QwenVLFamily", "QwenVLProcessor", "concat_prompt_batches"]
