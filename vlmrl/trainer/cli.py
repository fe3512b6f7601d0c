"""`vlmrl rm train`: the reward-model command line (console output lives here)."""

from __future__ import annotations

import argparse

RM_TRAIN_HELP = """Train an outcome reward model: a VLM with a scalar head, fitted on preference pairs with the
Bradley-Terry loss, from a YAML recipe plus dotted overrides (or overrides alone).

Examples:
  vlmrl rm train data.pairs.task=shapes_count data.pairs.n=300                 # pairs from a built-in task's labels
  vlmrl rm train data.pairs.path=prefs.jsonl model.name_or_path=runs/quickstart/checkpoint-0
  vlmrl rm train data.rollouts=runs/quickstart model.name_or_path=runs/quickstart/checkpoint-0
Then in a recipe: rewards: [{name: reward_model, path: runs/rm}]. Every key: `vlmrl rm train --show-config`;
docs/rewards.md ("Learned rewards") explains them."""


def cmd_rm_train(args) -> int:
    from vlmrl.config import to_dict
    from vlmrl.trainer.rm import load_rm_config

    recipe, overrides = (args.args[0], args.args[1:]) if args.args and "=" not in args.args[0] else (None, args.args)
    cfg = load_rm_config(recipe, overrides)  # a typo fails here, before anything is built
    if args.show_config:
        import yaml

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    from vlmrl.eval.metrics import format_interval
    from vlmrl.progress import BarProgress
    from vlmrl.trainer.rm import train_reward_model

    summary = train_reward_model(cfg, BarProgress())
    final = summary["final"]
    print(f"\nrun directory: {summary['run_dir']}")
    print(f"pairs: {summary['train_pairs']} for training, {summary['heldout_pairs']} held out")
    if final:
        print(f"held-out pairwise accuracy: {format_interval(final['pairwise_accuracy'], final['ci_low'], final['ci_high'])}"
              f" over {final['pairs']:.0f} pairs of {final['prompts']:.0f} prompts (95% interval over prompts)")
    print(f"reward model: {summary['checkpoint']} (wall time {summary['wall_seconds']:.0f} s)")
    print(f"use it in a recipe: rewards: [{{name: reward_model, path: {summary['run_dir']}}}]")
    return 0


def add_parser(sub) -> None:
    rm = sub.add_parser("rm", help="train outcome reward models (rm train)")
    rsub = rm.add_subparsers(dest="rm_cmd", required=True)
    t = rsub.add_parser("train", help="fit a reward model on preference pairs", description=RM_TRAIN_HELP,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("args", nargs="*", metavar="[RECIPE] [KEY=VALUE ...]",
                   help="a YAML recipe (optional) followed by dotted overrides such as data.rollouts=runs/quickstart")
    t.add_argument("--show-config", action="store_true", help="print the resolved config and exit")
    t.set_defaults(func=cmd_rm_train)
