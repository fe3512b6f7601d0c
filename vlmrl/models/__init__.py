"""Policies: the embedded tiny VLM and any supported Hugging Face VLM family, behind one loading path.

The names below load on first use (PEP 562), so `vlmrl` commands that stop at a bad argument never import torch.
"""

import importlib

_EXPORTS = {
    "PromptBatch": "vlmrl.models.batch", "PromptEmbeds": "vlmrl.models.batch",
    "PromptTooLongError": "vlmrl.models.batch", "concat_prompt_batches": "vlmrl.models.batch",
    "FAMILIES": "vlmrl.models.families", "Policy": "vlmrl.models.policy", "load_policy": "vlmrl.models.policy",
    "TinyModelConfig": "vlmrl.models.tiny", "build_tiny_vlm": "vlmrl.models.tiny", "embedded_family": "vlmrl.models.tiny",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'vlmrl.models' has no attribute {name!r}")
