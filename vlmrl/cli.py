"""The `vlmrl` command line: train, eval, report, data, serve. The CLI owns console output and progress bars."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from vlmrl.progress import BarProgress

TRAIN_HELP = """Train a VLM with RL (SFT warm-start, then GRPO), from a YAML recipe plus dotted overrides.

Without a recipe this runs the quickstart (vlmrl/recipes/quickstart.yaml): the embedded tiny Qwen2-VL learns to count
coloured shapes on a CPU.
Examples:
  vlmrl train
  vlmrl train recipes/quickstart.yaml trainer.lr=1e-4 rollout.group_size=4
  vlmrl train --resume runs/quickstart                    # a stopped or killed run, from its newest checkpoint
  vlmrl train trainer.steps=1200 --resume runs/quickstart  # the run's own config.yaml, with overrides on top
  vlmrl train recipes/quickstart.yaml --seeds 3 --control sft   # seeds, matched-compute control, OOD (docs/evaluation.md)
Every key, its type and its default: `vlmrl train --show-config`; docs/recipes.md explains them."""


def cmd_train(args) -> int:
    from vlmrl.config import QUICKSTART, load_config, to_dict

    recipe, overrides = None, list(args.args)
    if overrides and "=" not in overrides[0]:
        recipe = overrides.pop(0)
    if args.resume and recipe is None and not (args.seeds or args.control):
        from vlmrl.trainer.resume import run_recipe

        recipe = run_recipe(args.resume)  # the run's own config.yaml; overrides apply on top of it
    cfg = load_config(recipe or QUICKSTART, overrides)  # no recipe: the quickstart; fails on a typo before any model
    if args.show_config:
        import yaml

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    if args.seeds or args.control:
        return cmd_train_baselines(cfg, args)
    from vlmrl.trainer.run import train

    summary = train(cfg, BarProgress(), resume=args.resume)
    if "rollout_rank" in summary:  # (torchrun with rollout.rollout_ranks: training rank 0 prints the run's summary)
        print(f"rollout rank {summary['rollout_rank']}: produced {summary['produced_steps']} steps")
        return 0
    for note in summary["notes"]:  # shown as they happened too; repeated where a long run's output ends
        print(f"note: {note}")
    if summary.get("preempted"):
        print(f"\n{summary['preempted']}: stopped after step {summary['stopped_at']}; checkpoint: "
              f"{summary['checkpoint']}\nresume with: {summary['resume']}")
        return 0
    from vlmrl.eval.tables import train_table

    print(f"\nrun directory: {summary['run_dir']}")
    print(train_table(summary["start"], summary["final"]))  # with several tasks, each task's accuracy too
    print(f"wall time: {summary['wall_seconds']:.0f} s; final checkpoint: {summary['checkpoint']}")
    if summary["skipped_rows"]:
        print(f"skipped {summary['skipped_rows']} bad data rows (data.on_error=skip):")
        for problem in summary["skipped_problems"][:20]:
            print(f"  {problem}")
    if summary.get("fallen_warning"):  # the run's last word: a task that RL made worse
        print(f"warning: {summary['fallen_warning']}")
    return 0


def cmd_eval(args) -> int:
    from vlmrl.config import load_config
    from vlmrl.data import build_dataset
    from vlmrl.eval.generative import Solved, evaluate
    from vlmrl.eval.tables import eval_table
    from vlmrl.models import load_policy
    from vlmrl.models.preflight import check_device, resolve_model
    from vlmrl.rewards.specs import reward_specs
    from vlmrl.trainer.watch import truncation_warning

    ckpt = resolve_model(args.checkpoint, "vlmrl eval")  # a run directory -> its latest complete checkpoint
    recipe = ckpt / "config.yaml" if isinstance(ckpt, Path) and (ckpt / "config.yaml").exists() else None
    cfg = load_config(recipe, args.overrides)
    check_device(cfg.model.device)
    if args.benchmark:  # the benchmark's own data, prompt and scorer (vlmrl/eval/benchmarks, docs/benchmarks.md)
        from vlmrl.eval.benchmarks.cli import eval_benchmark

        return eval_benchmark(args, cfg, ckpt)
    spec = cfg.data.eval
    if args.data:
        spec = {"path": args.data, "on_error": cfg.data.on_error} if Path(args.data).exists() or "." in args.data \
            else {"task": args.data, "n": args.n or 300}
    elif args.n:
        spec = {**spec, "n": args.n} if isinstance(spec, dict) and "task" in spec else spec
    samples, report = build_dataset(spec, args.split, cfg.data.seed)
    if report is not None and report.skipped:
        print(f"{report.path}: skipped {report.skipped} bad rows", file=sys.stderr)
    policy = load_policy(ckpt, cfg.model.dtype, cfg.model.device, cfg.model.min_pixels, cfg.model.max_pixels,
                         cfg.model.autocast)
    rewards = reward_specs(cfg)
    from vlmrl.rewards.reward_model import bind_reward_models

    bind_reward_models(rewards, policy)  # a learned reward: on the policy's device, its tokenizer the policy's
    solved = Solved.from_config(cfg)  # what training counted as right
    results, full, evaluations = {}, {}, []
    progress = BarProgress()
    from vlmrl.agent import AgentSpec

    agent = AgentSpec.from_config(cfg.agent, policy.processor)  # an agentic run is evaluated with its tools
    for temperature in args.temperatures or cfg.eval.temperatures:
        progress.start(f"eval T={temperature}", len(samples))
        res = evaluate(policy, samples, agent=agent, temperature=temperature, max_new_tokens=cfg.eval.max_new_tokens,
                       batch_size=cfg.eval.batch_size, template=cfg.data.prompt_template,
                       max_prompt_length=cfg.data.max_prompt_length, rewards=rewards, seed=cfg.trainer.seed,
                       progress=progress.advance, n=args.samples, ks=args.k or cfg.eval.pass_k,
                       reflection_words=cfg.eval.reflection_words, backtracking_words=cfg.eval.backtracking_words,
                       solved=solved)
        progress.end()
        key, budget = ("agent.turn_tokens", cfg.agent.turn_tokens) if agent else \
            ("eval.max_new_tokens", cfg.eval.max_new_tokens)
        warning = truncation_warning(res["metrics"].get("truncated_share", 0.0), key, budget, f"eval T={temperature}")
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        full[f"T={temperature}"] = res
        evaluations.append((temperature, res))
        # the flat metrics at the top of each temperature; the breakdowns beside them
        results[f"T={temperature}"] = {**res["metrics"], "per_task": res["per_task"], "reflection": res["reflection"],
                                       "backtracking": res["backtracking"]}
    print(eval_table(full))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.out}")
    if args.samples_out:
        from vlmrl.eval.samples import write_samples

        lines = write_samples(args.samples_out, evaluations, samples)
        print(f"wrote {args.samples_out}: {lines} lines ({len(samples)} samples x {len(evaluations)} temperatures; "
              "answers, rewards, correctness)")
    return 0


def cmd_train_baselines(cfg, args) -> int:
    from vlmrl.eval.tables import baselines_table_text, seeds_table_text
    from vlmrl.trainer.control import train_with_baselines
    from vlmrl.trainer.sweep import run_seeds

    progress = BarProgress()
    if args.resume:
        print("error: --resume cannot be combined with --seeds or --control", file=sys.stderr)
        return 2
    if not args.seeds:
        summary = train_with_baselines(cfg, args.control, progress)
        print(f"\nrun directory: {summary['run_dir']} (baselines.json)")
        print(baselines_table_text(summary["baselines"]))
        return 0
    done = lambda r: print(f"\nseed done: {r['run_dir']}\n" + baselines_table_text(r["baselines"]))  # noqa: E731
    out = run_seeds(cfg, args.seeds, args.control, progress, on_seed_done=done)
    print(f"\nsweep root: {out['root']} (seeds.json)")
    print(seeds_table_text(out))
    print(f"report: vlmrl report {out['root']}")
    return 0


def cmd_report(args) -> int:
    from vlmrl.eval.report import write_report

    index = write_report(args.runs, args.out)
    print(f"wrote {index} (open it in a browser; the folder is self-contained)")
    return 0


def cmd_data(args) -> int:
    from vlmrl.data import TASKS, build_dataset, load_file

    if args.data_cmd == "tasks":
        for name in TASKS:
            print(name)
        return 0
    if args.data_cmd == "fetch":
        from vlmrl.data.hub import fetch_files, save_split

        if args.files:
            print(f"downloaded the repository of {args.name} to {fetch_files(args.name, args.out)}")
            return 0
        folder, rows = save_split(args.name, args.out, args.split, args.config)
        print(f"saved {rows} rows of {args.name}{f'[{args.split}]' if args.split else ''} to {folder}; use it as "
              f"{{hub: {folder}}} in a recipe or --data {folder} with --benchmark")
        return 0
    if args.data_cmd == "check":
        rows, report = load_file(args.path, on_error="skip")
        print(f"{report.path}: {report.loaded} rows loaded, {report.skipped} skipped")
        for problem in report.problems:
            print(f"  {problem}")
        return 1 if report.skipped else 0
    # export: write a built-in task as Visual-RFT JSONL + PNG files, the same format user data takes
    samples, _ = build_dataset({"task": args.task, "n": args.n}, args.split, args.seed)
    from vlmrl.data.export import write_rows

    out = write_rows(samples, Path(args.out) / f"{args.task}-{args.split}.jsonl", image_prefix=args.split)
    print(f"wrote {len(samples)} rows to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vlmrl", description="Reinforcement-learning post-training of VLMs.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="SFT warm-start + RL on a recipe", description=TRAIN_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("args", nargs="*", metavar="[RECIPE] [KEY=VALUE ...]",
                   help="a YAML recipe (optional) followed by dotted overrides such as trainer.lr=1e-5")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run exactly from its newest complete checkpoint "
                   "(or from RUN_DIR/checkpoint-N), with its own config.yaml as the recipe; overrides that change "
                   "the training are allowed and named in a warning")
    t.add_argument("--show-config", action="store_true", help="print the resolved config and exit")
    t.add_argument("--seeds", type=int, default=0, metavar="N",
                   help="run the recipe N times (trainer.seed, +1, ...) under trainer.output_dir and aggregate mean, "
                        "std and max of every eval metric into seeds.json")
    t.add_argument("--control", choices=["sft"],
                   help="also run a matched-compute control (sft: continued SFT from the same start on data.sft for "
                        "the RL phase's wall time) and evaluate start, RL and control in- and out-of-distribution "
                        "(eval.ood) into RUN_DIR/baselines.json")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="evaluate a checkpoint or model folder on held-out data",
                       description="Accuracy, pass@k, rewards (total and each component), answer and reasoning "
                                   "length, reflection and backtracking of CHECKPOINT on the recipe's held-out set "
                                   "(its config.yaml), or on --data (a task name or a JSONL/parquet file).")
    e.add_argument("checkpoint", help="a run directory (its latest complete checkpoint), RUN_DIR/checkpoint-N, a "
                                      "model folder or a hub name")
    e.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    e.add_argument("--data", help="a built-in task name or a data file (default: the recipe's data.eval); with "
                                  "--benchmark, a folder holding the benchmark's dataset (saved by vlmrl data fetch)")
    e.add_argument("--benchmark", metavar="NAME", help="a standard benchmark with its published prompt and scoring: "
                   "mathvista, mathverse, geometry3k, superclevr, refcoco, refcoco+, refcocog, vstar (NAME@SPLIT for "
                   "another split, e.g. refcoco@testA), or my_bench.py:NAME; greedy unless --temperatures "
                   "(docs/benchmarks.md)")
    e.add_argument("--max-new-tokens", type=int, default=0,
                   help="with --benchmark: the generation budget (default: the benchmark's protocol)")
    e.add_argument("--extract", choices=["rules", "judge"], default="rules",
                   help="with --benchmark: read answers by vlmrl's offline rules (default) or by the benchmark's "
                        "published judge prompts (mathvista, mathverse) on --judge-url")
    e.add_argument("--judge-url", help="with --extract judge: an OpenAI-compatible endpoint, e.g. "
                                       "http://127.0.0.1:8000/v1")
    e.add_argument("--judge-model", help="with --extract judge: the model the endpoint serves")
    e.add_argument("--judge-key-env", help="with --extract judge: the environment variable holding the API key")
    e.add_argument("--split", default="test", choices=["train", "test", "ood"], help="split of a built-in task")
    e.add_argument("--n", type=int, default=0, help="number of samples of a built-in task")
    e.add_argument("--temperatures", type=float, nargs="+",
                   help="decoding temperatures (0 = greedy); default eval.temperatures (0 0.6 1.0)")
    e.add_argument("--samples", type=int, default=8,
                   help="answers per sample at temperature > 0, for pass@k, mean@n and maj@n (greedy takes 1)")
    e.add_argument("--k", type=int, nargs="+", help="pass@k values to report (default eval.pass_k; k <= --samples)")
    e.add_argument("--out", help="also write the results as JSON here")
    e.add_argument("--samples-out", metavar="JSONL",
                   help="also write every sample here, one JSON line per sample and temperature: id, task, question, "
                        "solution, images, and each answer with its reward components, correctness and truncation")
    e.set_defaults(func=cmd_eval)

    r = sub.add_parser("report", help="write an HTML report (curves, tables, rollout gallery) of runs",
                       description="A self-contained HTML page with PNG plots for RUN_DIR: learning curves with seed "
                                   "bands, a before/after table, the baselines (start, RL, control; in-distribution "
                                   "and OOD) and a rollout gallery. Give several runs, or a --seeds sweep root, to "
                                   "aggregate seeds.")
    r.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories, or a sweep root holding seed*/ runs")
    r.add_argument("--out", help="output folder (default RUN_DIR/report)")
    r.set_defaults(func=cmd_report)

    d = sub.add_parser("data", help="list, export or check datasets")
    dsub = d.add_subparsers(dest="data_cmd", required=True)
    dsub.add_parser("tasks", help="list the built-in tasks")
    x = dsub.add_parser("export", help="write a built-in task as JSONL + PNG images (Visual-RFT format)")
    x.add_argument("task")
    x.add_argument("--n", type=int, default=20)
    x.add_argument("--split", default="train", choices=["train", "test", "ood"])
    x.add_argument("--seed", type=int, default=0)
    x.add_argument("--out", default="data")
    c = dsub.add_parser("check", help="load a JSONL/parquet file and report every bad row (file, line, problem)")
    c.add_argument("path")
    f = dsub.add_parser("fetch", help="save a hub dataset's split as a folder, for a machine without internet")
    f.add_argument("name", help="the dataset on the Hugging Face hub (owner/name)")
    f.add_argument("--split", help="the split to save (default: every split)")
    f.add_argument("--config", help="the dataset's configuration, if it has several")
    f.add_argument("--out", required=True, help="the folder to write (point a spec's 'hub:' or --data at it)")
    f.add_argument("--files", action="store_true", help="download the dataset's repository as it is (data files and "
                   "the image files they name, as V* Bench keeps them) instead of saving a split")
    d.set_defaults(func=cmd_data)
    from vlmrl.rewards.cli import add_parser as add_inspect_reward
    add_inspect_reward(sub)
    from vlmrl.models.cli import add_parser as add_export
    add_export(sub)
    from vlmrl.trainer.cli import add_parser as add_rm
    add_rm(sub)
    from vlmrl.reclip.cli import add_parser as add_reclip
    add_reclip(sub)
    from vlmrl.serve.cli import add_parser as add_serve
    add_serve(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command. vlmrl's own errors (vlmrl.errors) print as `error: ...` with exit code 2; anything else is
    a bug and keeps its traceback."""
    from vlmrl.errors import VlmrlError

    args = build_parser().parse_args(argv)
    from vlmrl.allocator import keep_freed_memory

    keep_freed_memory()  # VLMRL_MALLOC_REUSE=1: faster CPU steps for more memory (vlmrl/allocator.py)
    # our bars only (the model folder loads and writes are not worth one); read when transformers is first imported,
    # so a command refused up front never pays for importing it
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # imported already (a library user calling main): switch its bars off too
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    try:
        return args.func(args)
    except VlmrlError as e:  # names the key, file, line or sample and the fix: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
