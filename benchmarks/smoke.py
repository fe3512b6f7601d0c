"""The smallest mode of the benchmarks that train (`--smoke`): recipe overrides that make any `vlmrl train` of the
quickstart's kind take seconds, not minutes: a very small embedded model, a few prompts and held-out scenes, two SFT
steps and a batch of 2 prompts x 2 answers. Every stage still runs, so tests/test_benchmarks.py can run each script
as its users do and a benchmark that no longer runs against the current code fails a test. The numbers a smoke run
prints mean nothing."""

from __future__ import annotations

TINY_MODEL = ["model.tiny.hidden_size=32", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
              "model.tiny.intermediate_size=64", "model.tiny.vision_dim=32", "model.tiny.vision_heads=2",
              "model.tiny.vocab_size=400"]
SMALL_RUN = ["data.train.n=32", "data.sft.n=8", "data.eval.n=8", "sft.steps=2", "sft.batch_size=4",
             "rollout.prompts_per_step=2", "rollout.group_size=2"]
SMOKE = TINY_MODEL + SMALL_RUN
