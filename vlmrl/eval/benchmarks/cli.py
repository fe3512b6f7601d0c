"""`vlmrl eval MODEL --benchmark NAME`: a benchmark's published protocol on a checkpoint or model; prints tables."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from vlmrl.errors import ConfigError
from vlmrl.eval.benchmarks.run import load_benchmark, parse_benchmark, run_benchmark, scorer_spec
from vlmrl.eval.metrics import format_interval


def category_table(categories: dict[str, dict[str, dict]], label: str) -> str:
    """Accuracy (with its 95% interval) and n per category value, one block per category column."""
    lines = []
    for column, values in categories.items():
        width = max([len(column), *(len(v) for v in values)]) + 2
        lines += ["", f"{column:<{width}}{label:>30}{'n':>7}"]
        for value, m in values.items():
            cell = format_interval(m.get("accuracy"), m.get("accuracy_ci_low"), m.get("accuracy_ci_high"))
            lines.append(f"{value:<{width}}{cell:>30}{int(m.get('n') or 0):>7}")
    return "\n".join(lines)


def judge_options(args: Any) -> dict | None:
    """The judge of `--extract judge` (None for the offline rules), refused without --judge-url and --judge-model."""
    if getattr(args, "extract", "rules") != "judge":
        return None
    if not args.judge_url or not args.judge_model:
        raise ConfigError("--extract judge needs --judge-url (an OpenAI-compatible endpoint, e.g. "
                          "http://127.0.0.1:8000/v1) and --judge-model (the model it serves)")
    return {"base_url": args.judge_url, "model": args.judge_model, "api_key_env": args.judge_key_env or None}


def eval_benchmark(args: Any, cfg: Any, model: Any) -> int:
    """Load the benchmark's data (refused before the model loads when it is missing), evaluate at each temperature,
    print the tables, write --out and --samples-out."""
    from vlmrl.agent import AgentSpec
    from vlmrl.eval.tables import eval_table
    from vlmrl.models import load_policy
    from vlmrl.progress import BarProgress

    benchmark, split = parse_benchmark(args.benchmark)
    judge = judge_options(args)
    if judge is not None:
        scorer_spec(benchmark, judge)  # a benchmark without a published judge step is refused before any loading
    samples, report = load_benchmark(benchmark, args.data, split, args.n or None, cfg.data.on_error)
    if report.skipped:
        print(f"{report.path}: skipped {report.skipped} bad rows", file=sys.stderr)
    print(f"{benchmark.name}: {len(samples)} samples from {report.path}; protocol: {benchmark.source}")
    if judge is not None:
        print(f"answers read by the published judge-based extraction on {judge['model']} at {judge['base_url']}")
    if benchmark.notes:
        print(f"vlmrl differs from it: {benchmark.notes} (docs/benchmarks.md)")
    policy = load_policy(model, cfg.model.dtype, cfg.model.device, cfg.model.min_pixels, cfg.model.max_pixels,
                         cfg.model.autocast)
    agent = AgentSpec.from_config(cfg.agent, policy.processor)  # a zoom-in agent is evaluated with its tools
    budget = args.max_new_tokens or benchmark.max_new_tokens
    progress = BarProgress()
    full, results, evaluations = {}, {}, []
    for temperature in args.temperatures or [0.0]:
        progress.start(f"{benchmark.name} T={temperature}", len(samples))
        res = run_benchmark(policy, benchmark, samples, temperature=temperature, n=args.samples,
                            ks=args.k or cfg.eval.pass_k, max_new_tokens=budget, batch_size=cfg.eval.batch_size,
                            seed=cfg.trainer.seed, max_prompt_length=None, agent=agent,  # no cap: the protocol's prompt
                            progress=progress.advance, judge=judge)
        progress.end()
        label = f"T={temperature}"
        full[label] = res
        evaluations.append((temperature, res))
        results[label] = {**res["metrics"], "categories": res["categories"]}
    print(eval_table(full))
    for label, res in full.items():
        if res["categories"]:
            print(category_table(res["categories"], f"accuracy {label}"))
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": benchmark.name, "split": split or benchmark.split,
                                              "source": benchmark.source, "max_new_tokens": budget, **results},
                                             indent=2))
        print(f"wrote {args.out}")
    if args.samples_out:
        from vlmrl.eval.samples import write_samples

        lines = write_samples(args.samples_out, evaluations, samples, benchmark=benchmark.name)
        print(f"wrote {args.samples_out}: {lines} lines (every sample's prompt, answers, score)")
    return 0
