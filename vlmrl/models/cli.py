"""`vlmrl export`: turn a checkpoint into a plain model folder; with --merge, LoRA adapters are merged into their base.
The CLI owns the printing."""

from __future__ import annotations

import argparse
from typing import Any

HELP = """Write CHECKPOINT as a plain model folder OUT that transformers' from_pretrained (and vlmrl) load without
PEFT. A LoRA checkpoint holds only adapters and a pointer to its base weights: --merge folds W + (alpha/r) B A into
the base and saves the result.

Examples:
  vlmrl export runs/quickstart/checkpoint-900 exported/ --merge
  vlmrl export runs/qwen_lora/checkpoint-200 merged/ --merge --dtype bfloat16"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `export` command to the `vlmrl` command line."""
    p = subparsers.add_parser("export", help="write a checkpoint as a plain model folder (--merge: fold in LoRA)",
                              description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a run directory (its latest complete checkpoint) or RUN_DIR/checkpoint-N "
                                      "(full or LoRA adapters)")
    p.add_argument("out", help="output folder")
    p.add_argument("--merge", action="store_true", help="merge LoRA adapters into the base weights (required for a "
                                                        "LoRA checkpoint)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(func=cmd_export)
    return p


def cmd_export(args) -> int:
    from vlmrl.errors import ConfigError
    from vlmrl.models.policy import adapter_base
    from vlmrl.models.preflight import resolve_model
    from vlmrl.models.trainable import merge_checkpoint

    checkpoint = resolve_model(args.checkpoint, "vlmrl export")  # a run directory -> its latest complete checkpoint
    base = adapter_base(checkpoint)
    if base is not None and not args.merge:
        raise ConfigError(f"{checkpoint} holds LoRA adapters on {base}; add --merge to fold them in")
    out = merge_checkpoint(checkpoint, args.out, args.dtype)
    print(f"wrote {out}" + (f" (adapters merged into {base})" if base is not None else ""))
    return 0
