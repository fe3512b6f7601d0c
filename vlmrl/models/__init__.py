"""Policies: the embedded tiny VLM and any supported Hugging Face VLM family, behind one loading path."""

from vlmrl.models.batch import PromptBatch, PromptEmbeds, PromptTooLongError, concat_prompt_batches
from vlmrl.models.families import FAMILIES
from vlmrl.models.policy import Policy, load_policy
from vlmrl.models.tiny import TinyModelConfig, build_tiny_vlm

__all__ = ["FAMILIES", "Policy", "PromptBatch", "PromptEmbeds", "PromptTooLongError", "TinyModelConfig",
           "build_tiny_vlm", "concat_prompt_batches", "load_policy"]
