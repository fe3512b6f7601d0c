"""Model families behind one interface: `model_type` -> (processor class, model-side family class).

Adding a family is one small module here (subclass `VLProcessor` and `VLFamily`, override what differs) and one line
in `FAMILIES`; docs/models.md walks through it.
"""

from vlmrl.models.families.base import VLFamily
from vlmrl.models.families.gemma3 import Gemma3Family, Gemma3Processor
from vlmrl.models.families.idefics3 import Idefics3Family, Idefics3Processor, SmolVLMProcessor
from vlmrl.models.families.llava import LlavaFamily, LlavaNextFamily, LlavaNextProcessor, LlavaProcessor
from vlmrl.models.families.processor import ImageInputs, VLProcessor
from vlmrl.models.families.qwen_vl import Qwen3VLFamily, Qwen3VLProcessor, QwenVLFamily, QwenVLProcessor

FAMILIES: dict[str, tuple[type[VLProcessor], type[VLFamily]]] = {
    "qwen2_vl": (QwenVLProcessor, QwenVLFamily),
    "qwen2_5_vl": (QwenVLProcessor, QwenVLFamily),
    "qwen3_vl": (Qwen3VLProcessor, Qwen3VLFamily),
    "idefics3": (Idefics3Processor, Idefics3Family),
    "smolvlm": (SmolVLMProcessor, Idefics3Family),
    "llava": (LlavaProcessor, LlavaFamily),
    "llava_next": (LlavaNextProcessor, LlavaNextFamily),
    "gemma3": (Gemma3Processor, Gemma3Family),
}

__all__ = ["FAMILIES", "ImageInputs", "VLFamily", "VLProcessor"]
