"""`vlmrl inspect-reward`: score one (question, prediction, ground truth[, image]) with a recipe's rewards and judge,
printing every component, the total, failures, and the judge's raw feedback. The CLI owns the printing."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vlmrl.errors import ConfigError

HELP = """Score one answer with the rewards of a recipe (and its judge), and show every component.

Examples:
  vlmrl inspect-reward recipes/quickstart.yaml --question "How many red shapes?" \\
      --prediction "<answer>3</answer>" --solution 3
  vlmrl inspect-reward recipes/quickstart_judge.yaml --question "What color is the circle?" \\
      --prediction "<think>round, red</think><answer>red</answer>" --solution red --image scene.png
  vlmrl inspect-reward --reward accuracy --reward format --prediction "<answer>x^2+2x+1</answer>" \\
      --solution "(x+1)^2"
The prediction is the whole completion, tags included. --column KEY=VALUE adds a dataset column (value read as
YAML, e.g. --column 'options=[red, blue]'); --reward NAME replaces the recipe's rewards (weight 1 each)."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `inspect-reward` command to the `vlmrl` command line."""
    p = subparsers.add_parser("inspect-reward", help="score one answer with a recipe's rewards and judge",
                              description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("args", nargs="*", metavar="[RECIPE] [KEY=VALUE ...]", help="a YAML recipe and dotted overrides")
    p.add_argument("--question", default="", help="the question (the `problem` column)")
    p.add_argument("--prediction", required=True, help="the model's completion, tags included")
    p.add_argument("--solution", default="", help="the ground truth (the `solution` column)")
    p.add_argument("--image", action="append", default=[], help="an image file (repeat for several)")
    p.add_argument("--answer-type", choices=["number", "text", "box", "math", "choice"],
                   help="the `answer_type` column (default: inferred by each reward)")
    p.add_argument("--column", action="append", default=[], metavar="KEY=VALUE", help="another dataset column")
    p.add_argument("--reward", action="append", default=[], metavar="NAME", help="use these rewards instead")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_inspect_reward)
    return p


def _columns(args: argparse.Namespace) -> dict[str, list]:
    import yaml
    from PIL import Image

    columns: dict[str, Any] = {"problem": args.question, "solution": args.solution}
    if args.image:
        images = [Image.open(path).convert("RGB") for path in args.image]
        columns.update(images=images, width=images[0].width, height=images[0].height)
    if args.answer_type:
        columns["answer_type"] = args.answer_type
    for item in args.column:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--column {item!r}: expected KEY=VALUE")
        columns[key.strip()] = yaml.safe_load(raw)
    return {k: [v] for k, v in columns.items()}


def inspect(specs: list, prediction: str, columns: dict[str, list]) -> dict:
    """Score one prediction: {"components": {key: value}, "weights", "total", "failures", "errors", "details"}."""
    from vlmrl.rewards import compute_rewards

    out = compute_rewards(specs, [prediction], columns)
    return {
        "components": {k: v[0] for k, v in out.components.items()},
        "weights": {s.key: s.weight for s in specs},
        "total": float(out.total[0]),
        "failures": out.failures,
        "errors": out.errors,
        "details": {k: v[0] for k, v in out.details.items()},
        "metrics": {k: v for k, v in out.extra.items()},
    }


def _print_report(result: dict) -> None:
    print(f"{'component':<24}{'weight':>8}{'value':>10}")
    for key, value in result["components"].items():
        shown = "None" if value is None else f"{value:.4f}"
        print(f"{key:<24}{result['weights'][key]:>8g}{shown:>10}")
        if key in result["errors"]:
            print(f"  failure: {result['errors'][key]}")
    print(f"{'total':<24}{'':>8}{result['total']:>10.4f}")
    for key, detail in result["details"].items():
        if not isinstance(detail, dict):
            continue
        print(f"\n{key} feedback:")
        if detail.get("skipped"):
            print(f"  not sent: {detail['skipped']}")
            continue
        print(f"  verdict: {detail.get('verdict')}  score: {detail.get('score')}  cached: {detail.get('cached')}  "
              f"attempts: {detail.get('attempts')}")
        for reason, signal in zip(detail.get("reasons", []), detail.get("signals", []), strict=False):
            print(f"  {'+' if signal > 0 else '-' if signal < 0 else '*'} {reason}")
        if detail.get("error"):
            print(f"  error: {detail['error']}")
        print("  raw reply:")
        for line in (detail.get("raw") or "").splitlines() or [""]:
            print(f"    {line}")


def cmd_inspect_reward(args: argparse.Namespace) -> int:
    from vlmrl.config import load_config
    from vlmrl.rewards import FatalRewardError, RewardSpec
    from vlmrl.rewards.specs import reward_specs

    recipe, overrides = None, list(args.args)
    if overrides and "=" not in overrides[0]:
        recipe = overrides.pop(0)
    cfg = load_config(recipe, overrides)
    specs = [RewardSpec(name) for name in args.reward] or reward_specs(cfg)
    try:
        result = inspect(specs, args.prediction, _columns(args))
    except FatalRewardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        _print_report(result)
    return 0
