"""Policies: the embedded tiny VLM and any supported Hugging Face VLM, behind one loading path."""

from vlmrl.models.policy import Policy, load_policy
from vlmrl.models.qwen_vl import PromptBatch, PromptEmbeds, PromptTooLongError
from vlmrl.models.tiny import TinyModelConfig, build_tiny_vlm

__all__ = ["Policy", "PromptBatch", "PromptEmbeds", "PromptTooLongError", "TinyModelConfig", "build_tiny_vlm",
           "load_policy"]
