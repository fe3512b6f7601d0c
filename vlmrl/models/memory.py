"""A back-of-the-envelope GPU memory estimate for a recipe: weights, gradients, AdamW state, the reference, the KV
cache of generation, and the largest activations of generation and of the training forward. It counts the model's
parameters exactly (the architecture built on the `meta` device from its config, nothing downloaded when the config is
known below) and uses simple formulas for the rest; it is an estimate for choosing settings, not a measurement.

    python -m vlmrl.models.memory recipes/qwen2_5_vl_3b_lora.yaml recipes/qwen2_5_vl_3b_full.yaml
"""

from __future__ import annotations

import sys

import torch

from vlmrl.config import Config, load_config

GB = 1024**3
# published config.json values, so the estimate runs offline
KNOWN_CONFIGS = {
    "Qwen/Qwen2.5-VL-3B-Instruct": dict(
        model_type="qwen2_5_vl", tie_word_embeddings=True,
        text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                         num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31])),
}
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def model_config(name: str):
    from transformers import AutoConfig

    if name in KNOWN_CONFIGS:
        spec = dict(KNOWN_CONFIGS[name])
        return AutoConfig.for_model(spec.pop("model_type"), **spec)
    return AutoConfig.from_pretrained(name)


def estimate(cfg: Config, prompt_tokens: int) -> dict[str, float]:
    """GiB per component for `cfg` when a prompt (images included) is `prompt_tokens` long.

    - weights: all parameters x bytes(model.dtype); LoRA adapters in float32 (PEFT's default)
    - gradients + AdamW: trainable x (1 + 2) x bytes (frozen vision tower / projector excluded)
    - reference: a second copy of the weights under full fine-tuning with beta > 0; 0 under LoRA
    - kv_cache: P*G rows x (prompt + max_new_tokens) x layers x 2 x kv_heads x head_dim x 2 bytes (bf16)
    - generation_peak: the prefill of P*G rows (prompts are repeated per answer): ~3 x rows x prompt x intermediate
      x 2 bytes (the MLP's gate, up and product), no gradients
    - training_activations: micro_batch rows of S = prompt + max_new tokens; checkpointed: layers x m x S x hidden
      x 2 bytes (saved layer inputs) + one layer's working set (~(12 hidden + 4 intermediate) x m x S x 2 bytes);
      without checkpointing every layer keeps its working set
    - logits: one head chunk, never the batch: every log-prob pass runs the head on at most
      `vlmrl.models.forward.chunk_tokens_for(vocab)` tokens at a time (2^25 float32 logits) and recomputes them in
      backward, so ~4 float32 copies of one chunk (logits, softmax for the entropy, their gradient) plus the
      [m x max_new_tokens x hidden] hidden states the head reads
    - the no-grad passes (old log-probs, reference, critic values) run in the same chunks of rows and hold no
      gradients, so they are smaller than the training forward and are not added
    """
    from transformers import AutoModelForImageTextToText

    m = cfg.model
    config = model_config(m.name_or_path)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    from vlmrl.models.families import FAMILIES

    family = FAMILIES[config.model_type][1]
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    text = config.text_config
    b = BYTES[m.dtype]
    out = {"weights": total * b / GB}
    if m.lora.r > 0:
        prefix = (f"model.{family.language_attr}.",) + (family.vision_prefixes if m.lora.include_vision else ())
        lora = 0
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.startswith(prefix) \
                    and not name.startswith(family.projector_prefixes) \
                    and (m.lora.target_modules is None or name.rsplit(".", 1)[-1] in m.lora.target_modules):
                lora += m.lora.r * (module.in_features + module.out_features)
        out["weights"] += lora * 4 / GB
        out["gradients+adamw"] = lora * 3 * 4 / GB
        out["reference"] = 0.0
    else:
        frozen = sum(p.numel() for n, p in params.items()
                     if (m.freeze_vision and n.startswith(family.vision_prefixes)
                         and not n.startswith(family.projector_prefixes))
                     or (m.freeze_projector and n.startswith(family.projector_prefixes)))
        out["gradients+adamw"] = (total - frozen) * 3 * b / GB
        out["reference"] = total * b / GB if cfg.algorithm.beta > 0 else 0.0
    r = cfg.rollout
    rows = r.prompts_per_step * r.group_size
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    layers, hidden, inter = text.num_hidden_layers, text.hidden_size, text.intermediate_size
    out["kv_cache"] = rows * (prompt_tokens + r.max_new_tokens) * layers * 2 * text.num_key_value_heads \
        * head_dim * 2 / GB
    out["generation_peak"] = 3 * rows * prompt_tokens * inter * 2 / GB
    micro = cfg.trainer.micro_batch or rows
    seq = prompt_tokens + r.max_new_tokens
    if cfg.trainer.micro_batch_tokens:  # worst case: every row at full length
        micro = min(micro, max(1, cfg.trainer.micro_batch_tokens // seq))
    working = (12 * hidden + 4 * inter) * micro * seq * 2
    if m.gradient_checkpointing:
        out["training_activations"] = (layers * micro * seq * hidden * 2 + working) / GB
    else:
        out["training_activations"] = layers * working / GB
    from vlmrl.models.forward import chunk_tokens_for

    chunk = min(chunk_tokens_for(text.vocab_size), micro * r.max_new_tokens)
    out["logits"] = (chunk * text.vocab_size * 4 * 4 + micro * r.max_new_tokens * hidden * 4) / GB
    # generation and the training forward do not overlap; the larger of the two is the peak
    out["peak"] = (out["weights"] + out["gradients+adamw"] + out["reference"]
                   + max(out["kv_cache"] + out["generation_peak"], out["training_activations"] + out["logits"]))
    out["params"] = total / 1e9
    return out


def prompt_length(cfg: Config, text_tokens: int = 120) -> int:
    """Tokens of a one-image prompt at the recipe's pixel budget: max_pixels / (28 x 28) image tokens for Qwen."""
    return (cfg.model.max_pixels or 1280 * 28 * 28) // (28 * 28) + text_tokens


def main(argv: list[str]) -> int:
    for path in argv:
        cfg = load_config(path)
        prompt = prompt_length(cfg)
        est = estimate(cfg, prompt)
        print(f"{path}: {est.pop('params'):.2f}B parameters, prompts of {prompt} tokens")
        for k, v in est.items():
            print(f"  {k:22s} {v:6.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
