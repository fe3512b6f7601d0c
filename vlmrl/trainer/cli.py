"""`vlmrl rm train`: the reward-model command line (console output lives here)."""

from __future__ import annotations

import argparse

RM_TRAIN_HELP = """Train a reward model: a VLM with a scalar head, fitted on preference pairs with the Bradley-Terry
loss (an outcome RM), or on step-labelled answers with a per-step cross-entropy (a process RM, data.steps), from a
YAML recipe plus dotted overrides (or overrides alone).

Examples:
  vlmrl rm train data.pairs.task=shapes_count data.pairs.n=300                 # pairs from a built-in task's labels
  vlmrl rm train data.pairs.path=prefs.jsonl model.name_or_path=runs/quickstart/checkpoint-0
  vlmrl rm train data.rollouts=runs/quickstart model.name_or_path=runs/quickstart/checkpoint-0
  vlmrl rm train data.steps.path=steps.jsonl process.aggregate=min model.name_or_path=runs/digits/checkpoint-0
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
    what = "step-labelled answers" if cfg.data.steps is not None else "pairs"
    print(f"{what}: {summary['train_pairs']} for training, {summary['heldout_pairs']} held out")
    if final and cfg.data.steps is not None:
        print(f"held-out steps: {final['step_accuracy']:.1%} right or wrong as labelled over {final['steps']:.0f} "
              f"steps; wrong steps found: precision {final['error_precision']:.2f}, recall "
              f"{final['error_recall']:.2f}, F1 {final['error_f1']:.2f}")
    elif final:
        print(f"held-out pairwise accuracy: {format_interval(final['pairwise_accuracy'], final['ci_low'], final['ci_high'])}"
              f" over {final['pairs']:.0f} pairs of {final['prompts']:.0f} prompts (95% interval over prompts)")
    print(f"reward model: {summary['checkpoint']} (wall time {summary['wall_seconds']:.0f} s)")
    print(f"use it in a recipe: rewards: [{{name: reward_model, path: {summary['run_dir']}}}]")
    return 0


RM_LABEL_HELP = """Label reasoning steps automatically (Math-Shepherd) for a process reward model: the policy samples
answers to each prompt; every step of every answer is continued --continuations times from the answer up to that
step (by the policy, or by --completer, a stronger model), and its label is the share of continuations that reach
the right answer (--hard: whether any does). Writes a step-labelled JSONL (images beside it) for `vlmrl rm train
data.steps.path=FILE`.

With --judge URL --judge-model NAME the labels come from an LLM judge (any OpenAI-compatible endpoint) instead: each
step is shown with the question, image(s), reference answer and the steps before it, and labelled 1 if the judge
says it is right, else 0 (--judge-graded: the judge's probability, from its token log-probs). An answer with a step
the judge did not grade is left out and counted.

Examples:
  vlmrl rm label --policy runs/digits/checkpoint-600 --data '{task: digits_sum, n: 200}' --out runs/steps/train.jsonl
  vlmrl rm label --policy runs/digits/checkpoint-600 --data '{task: digits_sum, n: 200}' --out runs/steps/judged.jsonl \
      --judge http://127.0.0.1:8000/v1 --judge-model qwen2.5-vl-7b"""


def cmd_rm_label(args) -> int:
    import yaml

    from vlmrl.data import build_dataset
    from vlmrl.data.export import write_rows
    from vlmrl.errors import ConfigError
    from vlmrl.models import load_policy
    from vlmrl.trainer.prm_labels import label_steps, sample_answers

    if args.judge and not args.judge_model:
        raise ConfigError("--judge needs --judge-model: the name the server serves the judge under")
    if args.judge and args.completer:
        raise ConfigError("--completer continues the steps to label them and --judge grades them: give one")
    spec = yaml.safe_load(args.data)
    if not isinstance(spec, dict):
        raise ConfigError(f"--data {args.data!r}: expected a data spec such as '{{task: digits_sum, n: 200}}' or "
                          "'{path: prompts.jsonl}'")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    samples, _ = build_dataset(spec, args.split, args.seed)
    policy = load_policy(args.policy)
    answers = sample_answers(policy, samples, args.answers, args.max_new_tokens, args.temperature,
                             args.prompt_template, args.seed)
    texts = [[t for t, _ in a] for a in answers]
    if args.judge:
        from vlmrl.rewards.judge import JudgeClient
        from vlmrl.trainer.prm_judge import STEP_TEMPLATE, judge_steps

        client = JudgeClient(args.judge, args.judge_model, api_key_env=args.judge_api_key_env,
                             template=STEP_TEMPLATE, graded=args.judge_graded, concurrency=args.judge_concurrency,
                             max_tokens=args.judge_max_tokens)
        rows, count = judge_steps(client, samples, texts, args.split_steps, args.think_tag)
        source = (f"by the judge ({count['requests']} requests; {count['ungraded']} answers left out: a step "
                  f"without a verdict{': ' + count['error'] if count['error'] else ''})")
    else:  # Math-Shepherd's completer: the policy itself, or a stronger model continuing the policy's answers
        completer = load_policy(args.completer) if args.completer else policy
        rows = label_steps(completer, samples, texts, args.continuations, args.max_new_tokens, args.temperature,
                           args.split_steps, args.think_tag, args.hard, args.prompt_template, args.seed + 1)
    out = write_rows(rows, args.out)
    steps = sum(len(r["labels"]) for r in rows)
    wrong = sum(v < 0.5 for r in rows for v in r["labels"])
    if not args.judge:
        source = f"from {steps * args.continuations} continuations" + (f" by {args.completer}" if args.completer
                                                                       else "")
    print(f"{len(samples)} prompts, {sum(map(len, answers))} answers, {len(rows)} with reasoning steps: {steps} steps "
          f"labelled ({wrong} below 0.5) {source}")
    print(f"wrote {out}; train a process RM on it: vlmrl rm train data.steps.path={out} "
          f"model.name_or_path={args.policy}")
    return 0


def add_parser(sub) -> None:
    rm = sub.add_parser("rm", help="train outcome and process reward models (rm train, rm label)")
    rsub = rm.add_subparsers(dest="rm_cmd", required=True)
    lab = rsub.add_parser("label", help="label reasoning steps automatically from a policy's own samples",
                          description=RM_LABEL_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    lab.add_argument("--policy", required=True, help="the policy checkpoint that samples answers and continuations")
    lab.add_argument("--data", required=True, help="prompts with solutions: '{task: NAME, n: N}' or '{path: FILE}'")
    lab.add_argument("--out", required=True, help="the step-labelled JSONL to write (images go beside it)")
    lab.add_argument("--split", default="train", help="the data split (built-in tasks: train, test, ood)")
    lab.add_argument("--answers", type=int, default=4, help="answers sampled per prompt (default 4)")
    lab.add_argument("--continuations", type=int, default=8, help="continuations per step (default 8)")
    lab.add_argument("--completer", help="the checkpoint that continues each step (Math-Shepherd's completer; "
                     "default: --policy itself): a stronger model labels the policy's steps by what it can reach "
                     "from them")
    lab.add_argument("--hard", action="store_true", help="label 1 when any continuation is right (else the share)")
    lab.add_argument("--max-new-tokens", type=int, default=32, help="token budget of answers and continuations")
    lab.add_argument("--temperature", type=float, default=1.0)
    lab.add_argument("--split-steps", default="lines", choices=["lines", "sentences", "paragraphs"])
    lab.add_argument("--think-tag", default="think")
    lab.add_argument("--prompt-template", default="{problem}")
    lab.add_argument("--seed", type=int, default=0)
    lab.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    lab.add_argument("--judge", metavar="URL", help="label steps by an LLM judge at this OpenAI-compatible base URL "
                     "(e.g. http://127.0.0.1:8000/v1) instead of by continuations")
    lab.add_argument("--judge-model", help="the judge's model name (needed with --judge)")
    lab.add_argument("--judge-api-key-env", help="the environment variable holding the judge's API key")
    lab.add_argument("--judge-graded", action="store_true",
                     help="soft labels: the judge's probability of [RELEVANT] from its token log-probs")
    lab.add_argument("--judge-concurrency", type=int, default=8, help="judge requests in flight (default 8)")
    lab.add_argument("--judge-max-tokens", type=int, default=256, help="the judge's reply budget (default 256)")
    lab.set_defaults(func=cmd_rm_label)
    t = rsub.add_parser("train", help="fit a reward model on preference pairs", description=RM_TRAIN_HELP,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("args", nargs="*", metavar="[RECIPE] [KEY=VALUE ...]",
                   help="a YAML recipe (optional) followed by dotted overrides such as data.rollouts=runs/quickstart")
    t.add_argument("--show-config", action="store_true", help="print the resolved config and exit")
    t.set_defaults(func=cmd_rm_train)
