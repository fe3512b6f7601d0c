"""Tiny, randomly initialised models of every supported family, built offline in code (nothing is downloaded).

Each is the real transformers architecture (`Idefics3ForConditionalGeneration`, `LlavaNextForConditionalGeneration`,
...) at toy size, with a byte-level BPE trained on the task vocabulary plus the family's special tokens, its chat
template and its PIL image processor, saved with `save_pretrained` so it loads through `load_policy` like a hub
checkpoint. The tests use them to check every family's invariants; `build_tiny_family("llava", ...)` also gives a
quick way to try a family end to end on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from vlmrl.config import TinyModelConfig
from vlmrl.models.families.gemma3 import CHAT_TEMPLATE as GEMMA3_TEMPLATE
from vlmrl.models.families.idefics3 import CHAT_TEMPLATE as IDEFICS3_TEMPLATE
from vlmrl.models.families.llava import CHAT_TEMPLATE as LLAVA_TEMPLATE
from vlmrl.models.tiny import SPECIAL_TOKENS, mrope_section, tiny_qwen2vl_config, tiny_qwen3vl_config, train_tokenizer

TINY_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3", "smolvlm", "llava", "llava_next", "gemma3")
IDEFICS3_TOKENS = (["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<image>", "<fake_token_around_image>",
                    "<global-img>"] + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])
LLAVA_TOKENS = ["<pad>", "<s>", "</s>", "<image>"]
GEMMA3_TOKENS = ["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                 "<image_soft_token>"]
SIZE = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                       vision_depth=2, vision_dim=32, vision_heads=2, vocab_size=400, initializer_range=0.1,
                       min_pixels=56 * 56, max_pixels=84 * 84)


def _tokenizer(family: str, texts: list[str], vocab_size: int):
    if family.startswith("qwen"):
        return train_tokenizer(texts, vocab_size)
    if family in ("idefics3", "smolvlm"):
        return train_tokenizer(texts, vocab_size, IDEFICS3_TOKENS, eos_token="<end_of_utterance>",
                               pad_token="<|endoftext|>", chat_template=IDEFICS3_TEMPLATE)
    if family.startswith("llava"):
        return train_tokenizer(texts, vocab_size, LLAVA_TOKENS, eos_token="</s>", pad_token="<pad>", bos_token="<s>",
                               chat_template=LLAVA_TEMPLATE)
    return train_tokenizer(texts, vocab_size, GEMMA3_TOKENS, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>",
                           chat_template=GEMMA3_TEMPLATE)


def _text(tok, cfg: TinyModelConfig, **extra) -> dict:
    extra.setdefault("bos_token_id", tok.bos_token_id if tok.bos_token_id is not None else tok.pad_token_id)
    return dict(vocab_size=len(tok), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=1024,
                initializer_range=cfg.initializer_range, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                **extra)


def _vision(cfg: TinyModelConfig, **extra) -> dict:
    return dict(hidden_size=cfg.vision_dim, intermediate_size=2 * cfg.vision_dim, num_hidden_layers=cfg.vision_depth,
                num_attention_heads=cfg.vision_heads, initializer_range=cfg.initializer_range, **extra)


def _mrope(cfg: TinyModelConfig, **extra) -> dict:
    return {"rope_type": "default", "rope_theta": 10000.0,
            "mrope_section": mrope_section(cfg), **extra}


def tiny_family_parts(family: str, tok, cfg: TinyModelConfig):
    """(model config, image processor) of a tiny `family` model whose special-token ids match `tok`."""
    import transformers as tf

    ids = tok.convert_tokens_to_ids
    qwen_ids = dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                    vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    pixels = dict(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    if family == "qwen2_vl":
        return tiny_qwen2vl_config(tok, cfg), tf.Qwen2VLImageProcessorPil(**pixels)
    if family == "qwen2_5_vl":
        config = tf.Qwen2_5_VLConfig(
            text_config=_text(tok, cfg, rope_parameters=_mrope(cfg), tie_word_embeddings=True),
            vision_config=dict(depth=cfg.vision_depth, hidden_size=cfg.vision_dim, intermediate_size=2 * cfg.vision_dim,
                               num_heads=cfg.vision_heads, out_hidden_size=cfg.hidden_size, window_size=56,
                               fullatt_block_indexes=[cfg.vision_depth - 1], initializer_range=cfg.initializer_range),
            tie_word_embeddings=True, **qwen_ids)
        return config, tf.Qwen2VLImageProcessorPil(**pixels)
    if family == "qwen3_vl":
        return tiny_qwen3vl_config(tok, cfg), tf.Qwen2VLImageProcessorPil(patch_size=16, **pixels)
    if family in ("idefics3", "smolvlm"):
        cls = tf.Idefics3Config if family == "idefics3" else tf.SmolVLMConfig
        config = cls(vision_config=_vision(cfg, image_size=32, patch_size=8),
                     text_config=dict(model_type="llama", **_text(tok, cfg)), scale_factor=2,
                     image_token_id=ids("<image>"))
        proc = tf.Idefics3ImageProcessorPil if family == "idefics3" else tf.SmolVLMImageProcessorPil
        return config, proc(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    if family in ("llava", "llava_next"):
        vision = dict(model_type="clip_vision_model", image_size=32, patch_size=8, projection_dim=cfg.vision_dim,
                      **_vision(cfg))
        common = dict(vision_config=vision, text_config=dict(model_type="llama", **_text(tok, cfg)),
                      image_token_id=ids("<image>"), image_seq_length=16, vision_feature_layer=-2,
                      vision_feature_select_strategy="default")
        crop = dict(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        if family == "llava":
            return tf.LlavaConfig(**common), tf.LlavaImageProcessorPil(**crop)
        pinpoints = [[32, 64], [64, 32], [64, 64]]
        return (tf.LlavaNextConfig(image_grid_pinpoints=pinpoints, **common),
                tf.LlavaNextImageProcessorPil(image_grid_pinpoints=pinpoints, **crop))
    if family == "gemma3":
        text = _text(tok, cfg, head_dim=cfg.hidden_size // cfg.num_heads, sliding_window=16,
                     layer_types=["sliding_attention", "full_attention"])
        config = tf.Gemma3Config(text_config=text,
                                 vision_config=dict(model_type="siglip_vision_model", image_size=32, patch_size=8,
                                                    **_vision(cfg)),
                                 mm_tokens_per_image=4, boi_token_index=ids("<start_of_image>"),
                                 eoi_token_index=ids("<end_of_image>"), image_token_index=ids("<image_soft_token>"),
                                 initializer_range=cfg.initializer_range)
        return config, tf.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    raise ValueError(f"unknown tiny family {family!r}; one of {TINY_FAMILIES}")


def build_tiny_family(family: str, out_dir: str | Path, texts: Iterable[str], cfg: TinyModelConfig | None = None,
                      seed: int = 0) -> Path:
    """Build a tiny randomly initialised `family` model with its tokenizer and image processor in `out_dir`."""
    from transformers import AutoModelForImageTextToText

    cfg = cfg or SIZE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(family, list(texts), cfg.vocab_size)
    config, image_processor = tiny_family_parts(family, tok, cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
        with torch.no_grad():  # weights some architectures start at zero (Gemma 3's projector): random, so they count
            for p in model.parameters():
                if p.dim() >= 2 and not p.any():
                    p.normal_(0.0, cfg.initializer_range)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    image_processor.save_pretrained(out)
    return out


__all__ = ["SPECIAL_TOKENS", "TINY_FAMILIES", "build_tiny_family", "tiny_family_parts"]
