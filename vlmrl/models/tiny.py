"""The embedded VLM: a real Qwen2-VL (or Qwen3-VL) architecture, small enough to learn the built-in tasks on a CPU.

Everything is built offline, in code: a byte-level BPE tokenizer trained on the task vocabulary with Qwen's special
tokens, a `Qwen2VLImageProcessorPil` (no torchvision needed) and a `Qwen2VLForConditionalGeneration` from a config
(`Qwen3VLForConditionalGeneration` with `family: qwen3_vl`, whose vision tower adds learned absolute position
embeddings: the one of the two that learns where things are, `embedded_family`).
`build_tiny_vlm` writes them to a folder with `save_pretrained`, so the tiny model loads exactly like a hub model:
through `vlmrl.models.load_policy(folder)`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from vlmrl.config import TinyModelConfig
from vlmrl.models.families.qwen_vl import CHAT_TEMPLATE  # Qwen's format, so `apply_chat_template` works on it

# Qwen2-VL's special tokens, in Qwen's order; the tiny tokenizer keeps the names so prompts look like Qwen prompts.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512, special_tokens: list[str] | None = None,
                    eos_token: str = "<|im_end|>", pad_token: str = "<|endoftext|>", bos_token: str | None = None,
                    chat_template: str = CHAT_TEMPLATE, extra_tokens: Iterable[str] = ()):
    """A byte-level BPE trained on `texts`, wrapped as a `PreTrainedTokenizerFast`; special tokens default to
    Qwen's (other families pass theirs, see `vlmrl.models.tiny_families`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = special_tokens or SPECIAL_TOKENS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The answer/think tags and the chat scaffolding are part of every sequence: include them in the corpus.
    scaffold = ["<think>", "</think>", "<answer>", "</answer>", "user\n", "assistant\n", "system\n"]
    tok.train_from_iterator(list(texts) + scaffold * 50, trainer=trainer)
    extra = {"bos_token": bos_token} if bos_token else {}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos_token,
        pad_token=pad_token,
        additional_special_tokens=[t for t in specials if t not in (pad_token, bos_token)],
        padding_side="left",
        **extra,
    )
    # Answer and reasoning tags as single tokens: short answers, and a format the tiny model learns in few steps.
    fast.add_tokens(["<think>", "</think>", "<answer>", "</answer>", *extra_tokens])
    fast.chat_template = chat_template
    return fast


def mrope_section(cfg: TinyModelConfig) -> list[int]:
    """M-RoPE splits each head's rotary half-dimension into temporal, height and width sections."""
    half = cfg.hidden_size // cfg.num_heads // 2
    return [half - 2 * (half // 3), half // 3, half // 3]


def tiny_qwen2vl_config(tokenizer, cfg: TinyModelConfig):
    """A `Qwen2VLConfig` of the given size whose special-token ids match `tokenizer`."""
    from transformers import Qwen2VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads,
            max_position_embeddings=1024,
            initializer_range=cfg.initializer_range,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section(cfg)},
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
            tie_word_embeddings=True,
        ),
        vision_config=dict(
            depth=cfg.vision_depth,
            embed_dim=cfg.vision_dim,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.vision_heads,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            initializer_range=cfg.initializer_range,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        initializer_range=cfg.initializer_range,
    )


def tiny_qwen3vl_config(tokenizer, cfg: TinyModelConfig):
    """A `Qwen3VLConfig` of the given size whose special-token ids match `tokenizer`: 16-px patches, learned vision
    position embeddings (an 8 x 8 table, interpolated to each image's grid), deepstack features from the first vision
    block, interleaved M-RoPE."""
    from transformers import Qwen3VLConfig

    head_dim = cfg.hidden_size // cfg.num_heads
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads, head_dim=head_dim, max_position_embeddings=1024,
                initializer_range=cfg.initializer_range, pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
                                 "mrope_section": mrope_section(cfg)})
    vision = dict(depth=cfg.vision_depth, hidden_size=cfg.vision_dim, intermediate_size=2 * cfg.vision_dim,
                  num_heads=cfg.vision_heads, out_hidden_size=cfg.hidden_size, patch_size=16,
                  num_position_embeddings=64, deepstack_visual_indexes=[0], initializer_range=cfg.initializer_range)
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                         image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                         vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


def embedded_family(cfg: TinyModelConfig, *splits: Iterable[dict]) -> str:
    """The architecture `family: auto` picks: Qwen3-VL where the data holds box answers, else Qwen2-VL.

    On one-object boxes of the built-in scenes (3,000 labelled rows, 3,000 SFT steps, the quickstart's size) the
    embedded Qwen3-VL reaches 59-63% held-out at IoU >= 0.5 and the Qwen2-VL 14-15% (two seeds): Qwen2-VL's vision
    tokens carry no absolute position (2-D rotary only), so where a shape is must be read from attention patterns.
    """
    if cfg.family != "auto":
        return cfg.family
    boxes = any(s.get("answer_type") == "box" for samples in splits for s in samples)
    return "qwen3_vl" if boxes else "qwen2_vl"


def build_tiny_vlm(out_dir: str | Path, texts: Iterable[str], cfg: TinyModelConfig | None = None, seed: int = 0,
                   extra_tokens: Iterable[str] = (), family: str | None = None) -> Path:
    """Build the embedded VLM (tokenizer, image processor, randomly initialised model) and save it to `out_dir`.

    `family`: qwen2_vl or qwen3_vl (default: `cfg.family`, with "auto" as qwen2_vl; `embedded_family` resolves
    "auto" from the data). `extra_tokens` become single tokens too (the tool-call tags of agentic runs, as in Qwen's
    own tokenizer). The result is a folder that `load_policy` (and `from_pretrained`) load.
    """
    from transformers import AutoModelForImageTextToText, Qwen2VLImageProcessorPil

    cfg = cfg or TinyModelConfig()
    family = family or embedded_family(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(texts, cfg.vocab_size, extra_tokens=extra_tokens)
    if family not in ("qwen2_vl", "qwen3_vl"):
        raise ValueError(f"embedded family {family!r}: qwen2_vl or qwen3_vl")
    qwen3 = family == "qwen3_vl"
    image_processor = Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels,
                                               **({"patch_size": 16} if qwen3 else {}))
    config = (tiny_qwen3vl_config if qwen3 else tiny_qwen2vl_config)(tokenizer, cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    return out
