"""A process reward model with automatic step labels against an outcome RM and majority vote, on a built-in task
whose reasoning steps are right or wrong on their own: best-of-8 selection accuracy with intervals, and how well each
PRM step score agrees with the step's true correctness.

    python benchmarks/prm_digits.py --seeds 0 1 --out runs/prm_digits

The task: digits_sum (handwritten digits from scikit-learn, 2-3 per image), answered as one digit read per line,
then the sum: `<think>5\\n4\\n3</think><answer>12</answer>`. Step k is right when line k is digit k; the answer is
right when the sum is. Per seed, all through the command line a user runs:

1. the policy: `vlmrl train` SFT-only (trainer.steps=0) on --sft labelled rows written in that format;
2. step labels: `vlmrl rm label --hard` (Math-Shepherd: --answers answers per prompt from the policy, each step
   continued --continuations times; label = whether any continuation reaches the right sum, or with --soft the
   share that does) on --label prompts of the training split;
3. the PRM: `vlmrl rm train data.steps.path=...` on those labels (aggregate: min over steps); the ORM: `vlmrl rm
   train data.pairs.path=...` on (right, wrong) pairs of the same answers, from the same policy checkpoint and steps;
4. held-out (--test prompts of the test split, disjoint handwriting): --n answers per prompt sampled from the policy;
   selection accuracy of best-of-n by the PRM, by the ORM, of majority vote over the answers, of a majority vote
   weighted by the PRM's scores, of one answer (mean@n) and pass@n; each with its 95% interval over prompts, and the PRM's margin over majority vote with a paired
   bootstrap interval. Step level: each held-out step's PRM probability against its true correctness (a line that
   is not the digit there, or past the last digit, is wrong): accuracy and precision/recall/F1 of finding wrong
   steps.

Prints a markdown table per seed and writes the raw numbers to --results.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from smoke import TINY_MODEL  # noqa: E402

TEMPLATE = "<think>{steps}</think><answer>{solution}</answer>"


def vlmrl(*args: str, log: Path) -> None:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-m", "vlmrl", *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"vlmrl {args[0]} {args[1] if len(args) > 1 else ''} failed ({done.returncode}); see {log}")
    print(f"  vlmrl {' '.join(args[:2])}: {time.perf_counter() - t0:.0f} s", flush=True)


def write_data(out: Path, args, seed: int) -> dict[str, Path]:
    from vlmrl.data import make_task
    from vlmrl.data.export import write_rows

    files = {}
    for part, n, split, data_seed in (("sft", args.sft, "train", 1000 + seed), ("label", args.label, "train", seed),
                                      ("test", args.test, "test", seed)):
        digits = {"label": args.label_digits, "test": args.test_digits}.get(part) or args.num_digits
        rows = make_task("digits_sum", n, split, seed=data_seed, num_digits=tuple(digits),
                         style=args.style)
        for r in rows:
            r["steps"] = "\n".join(gold_steps(r["digits"], args.format))
        files[part] = write_rows(rows, out / f"{part}.jsonl")
    return files


def pairs_file(steps_file: Path, out: Path, seed: int) -> tuple[Path, int, int]:
    """(right, wrong) answer pairs to the same prompt from a step-labelled file's answers (their `correct`), in the
    offline DPO format, at most 4 per prompt: (the file, pairs, prompts with pairs)."""
    rng = random.Random(seed)
    by_prompt: dict[str, list[dict]] = {}
    for line in steps_file.read_text().splitlines():
        row = json.loads(line)
        by_prompt.setdefault(row["group"], []).append(row)
    pairs = []
    for rows in by_prompt.values():
        right = sorted({r["completion"] for r in rows if r["correct"]})
        wrong = sorted({r["completion"] for r in rows if not r["correct"]})
        chosen = [(a, b) for a in right for b in wrong]
        for a, b in rng.sample(chosen, min(4, len(chosen))):
            pairs.append({"image": rows[0]["image"], "prompt": rows[0]["problem"], "chosen": a, "rejected": b,
                          "id": f"{rows[0]['group']}#{len(pairs)}", "group": rows[0]["group"]})
    out.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return out, len(pairs), len({p["group"] for p in pairs})


def gold_steps(digits: list[int], fmt: str = "lines") -> list[str]:
    """The right reasoning lines: one digit each ("lines"), or the first digit and then the running sum, one addition
    a line ("running": 5, 5+4=9, 9+3=12)."""
    if fmt == "lines":
        return [str(d) for d in digits]
    lines, total = [str(digits[0])], digits[0]
    for d in digits[1:]:
        lines.append(f"{total}+{d}={total + d}")
        total += d
    return lines


def true_step_labels(completion: str, digits: list[int], fmt: str = "lines") -> list[float]:
    """Each reasoning step of `completion` is right (1.0) when it is the right line at its place, else 0.0 (a line
    past the last digit is wrong). In the running format a right line carries the right running sum, so a line
    after a wrong sum is wrong too (as a Math-Shepherd label would have it)."""
    from vlmrl.rewards.reasoning import step_spans

    gold = gold_steps(digits, fmt)
    steps = [completion[a:b] for a, b in step_spans(completion)]
    return [float(k < len(gold) and s == gold[k]) for k, s in enumerate(steps)]


def gold_steps_file(steps_file: Path, out: Path, fmt: str) -> Path:
    """The same labelled answers with each step's true correctness as its label (`true_step_labels`): what a PRM
    learns when its labels are perfect, the ceiling of automatic labels on these answers."""
    rows = [json.loads(line) for line in steps_file.read_text().splitlines()]
    out.write_text("".join(json.dumps({**r, "labels": true_step_labels(r["completion"], r["digits"], fmt)}) + "\n"
                           for r in rows))
    return out


def evaluate(policy_dir: Path, prm_dir: Path, orm_dir: Path, test_file: Path, args, seed: int,
             gold_dir: Path | None = None, base_dir: Path | None = None) -> dict:
    import torch

    from vlmrl.data import build_dataset
    from vlmrl.eval.metrics import (
        accuracy_interval,
        answer_key,
        best_of_n,
        bootstrap_interval,
        majority_vote,
        weighted_vote,
    )
    from vlmrl.models import load_policy
    from vlmrl.models.preflight import resolve_model
    from vlmrl.models.reward_model import RewardModel
    from vlmrl.rewards import RewardSpec, compute_rewards
    from vlmrl.trainer.prm import row_logits, step_classification
    from vlmrl.trainer.prm_labels import sample_answers, verdicts

    def answered(folder: Path) -> tuple[list, list[bool]]:
        """args.n sampled answers per held-out prompt from the model in `folder`: [(sample, text, truncated)] in
        prompt order, and whether each is right."""
        answers = sample_answers(load_policy(folder), samples, args.n, args.max_new_tokens, 1.0, seed=10_000 + seed)
        flat = [(s, text, trunc) for s, group in zip(samples, answers, strict=True) for text, trunc in group]
        return flat, verdicts([s for s, _, _ in flat], [t for _, t, _ in flat], [tr for _, _, tr in flat])

    def summary(groups: list[list[bool]]) -> tuple[float, float, float]:
        """The mean over prompts of each prompt's share right, and its 95% interval."""
        return sum(sum(g) / len(g) for g in groups) / len(groups), *accuracy_interval(groups)

    samples, _ = build_dataset({"path": str(test_file)}, "test", seed)
    flat, right = answered(policy_dir)
    columns = {k: [s[k] for s, _, _ in flat] for k in ("id", "problem", "solution", "images")}
    columns["completion_truncated"] = [tr for _, _, tr in flat]
    texts = [t for _, t, _ in flat]
    scores = {"orm": [None] * len(texts)}  # no ORM (too few pairs to train one): it picks nothing
    for name, folder in (("prm", prm_dir), ("orm", orm_dir), ("prm_gold", gold_dir)):
        if folder is not None:
            out = compute_rewards([RewardSpec("reward_model", kwargs={"path": str(folder)})], texts, columns)
            scores[name] = out.components["reward_model"]
    n = args.n
    per_prompt = {"prm": [], "prm_vote": [], "orm": [], "majority": [], "single": [], "pass": [],
                  **({"prm_gold": []} if gold_dir is not None else {})}
    for p in range(len(samples)):
        ok = right[p * n:(p + 1) * n]
        per_prompt["prm"].append(best_of_n(scores["prm"][p * n:(p + 1) * n], ok))
        per_prompt["orm"].append(best_of_n(scores["orm"][p * n:(p + 1) * n], ok))
        if gold_dir is not None:
            per_prompt["prm_gold"].append(best_of_n(scores["prm_gold"][p * n:(p + 1) * n], ok))
        keys = [answer_key(t, tr, "number") for _, t, tr in flat[p * n:(p + 1) * n]]
        per_prompt["majority"].append(majority_vote(keys, ok))
        per_prompt["prm_vote"].append(weighted_vote(keys, scores["prm"][p * n:(p + 1) * n], ok))
        per_prompt["single"].append(ok)
        per_prompt["pass"].append(any(ok))
    table = {}
    for name, values in per_prompt.items():
        table[name] = summary(values if name == "single" else [[v] for v in values])
    for a, b in (("prm", "majority"), ("prm", "orm"), ("prm_vote", "majority"),
                 *((("prm_gold", "majority"),) if gold_dir is not None else ())):
        diff = [float(x) - float(y) for x, y in zip(per_prompt[a], per_prompt[b], strict=True)]
        table[f"{a}_minus_{b}"] = (sum(diff) / len(diff), *bootstrap_interval(diff))
    # step level: the PRM's probability of each step against the step's true correctness
    prm = RewardModel.from_pretrained(resolve_model(prm_dir, "the PRM"))
    prm.train(False)
    rows = [{**s, "completion": t} for s, t, _ in flat if true_step_labels(t, s["digits"], args.format)]
    probs, gold = [], []
    with torch.no_grad():
        for start in range(0, len(rows), 32):
            chunk = rows[start:start + 32]
            probs += torch.sigmoid(torch.cat(row_logits(prm, chunk))).tolist()
            gold += [v for r in chunk for v in true_step_labels(r["completion"], r["digits"], args.format)]
    result = {"selection": table, "steps": step_classification(probs, gold), "answers": len(flat),
              "prompts": len(samples), "step_auc": roc_auc(probs, gold)}
    if base_dir is not None:  # the stronger model the RMs start from, answering itself: what it would do as the policy
        flat_b, ok_b = answered(base_dir)
        single = [ok_b[p * n:(p + 1) * n] for p in range(len(samples))]
        major = [[majority_vote([answer_key(t, tr, "number") for _, t, tr in flat_b[p * n:(p + 1) * n]],
                                ok_b[p * n:(p + 1) * n])] for p in range(len(samples))]
        result["rm_base"] = {"single": summary(single), "majority": summary(major)}
    return result


def roc_auc(scores: list[float], labels: list[float]) -> float | None:
    """How well the PRM's step scores separate right steps from wrong ones, whatever the threshold (None when the
    steps are all of one kind)."""
    from sklearn.metrics import roc_auc_score

    gold = [y >= 0.5 for y in labels]
    return float(roc_auc_score(gold, scores)) if 0 < sum(gold) < len(gold) else None


def run_seed(seed: int, args, out_root: Path) -> dict:
    out = out_root / f"seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    files = write_data(out / "data", args, seed)
    threads = f"trainer.threads={args.threads}"

    def sft(folder: Path, steps: int) -> Path:
        """`vlmrl train` SFT-only for `steps` steps into `folder` (or, with --reuse, the checkpoint already there)."""
        if args.reuse and (folder / "checkpoint-0").is_dir():
            print(f"  reusing {folder / 'checkpoint-0'}", flush=True)
        else:
            vlmrl("train", f"data.train={{path: {files['label']}}}", f"data.sft={{path: {files['sft']}}}",
                  f"data.eval={{path: {files['test']}}}", f"sft.target_template={TEMPLATE}", f"sft.steps={steps}",
                  "trainer.steps=0", f"rollout.max_new_tokens={args.max_new_tokens}",
                  f"eval.max_new_tokens={args.max_new_tokens}", f"trainer.seed={seed}", threads,
                  f"trainer.output_dir={folder}", *args.overrides, log=folder.with_suffix(".log"))
        return folder / "checkpoint-0"

    checkpoint = sft(out / "policy", args.sft_steps)
    # what every RM starts from: the policy itself, or a stronger model (--rm-sft-steps)
    base = sft(out / "rm_base", args.rm_sft_steps) if args.rm_sft_steps else checkpoint
    completer = base if args.completer == "rm-base" else checkpoint
    for stale in ("labels", "prm", "orm", "prm_gold"):  # everything after the SFT runs is made again
        shutil.rmtree(out / stale, ignore_errors=True)
    steps_file = out / "labels" / "steps.jsonl"
    vlmrl("rm", "label", "--policy", str(checkpoint), "--completer", str(completer), "--data",
          f"{{path: {files['label']}}}", "--out", str(steps_file), "--answers", str(args.answers), "--continuations",
          str(args.continuations), "--max-new-tokens", str(args.max_new_tokens), "--seed", str(seed), "--threads",
          str(args.threads), *([] if args.soft else ["--hard"]), log=out / "label.log")
    labelled = [json.loads(line) for line in steps_file.read_text().splitlines()]
    pairs, n_pairs, pair_prompts = pairs_file(steps_file, out / "labels" / "pairs.jsonl", seed)
    common = [f"model.name_or_path={base}", f"trainer.steps={args.rm_steps}", "trainer.eval_every=0",
              "data.max_answer_tokens=64", f"trainer.seed={seed}", f"data.seed={seed}", threads,
              f"model.logprob_term={str(args.logprob_term).lower()}"]
    vlmrl("rm", "train", f"data.steps.path={steps_file}", *common, f"trainer.output_dir={out / 'prm'}",
          log=out / "prm.log")
    orm = out / "orm" if pair_prompts >= 2 else None  # a held-out share of the prompts needs two
    if orm is None:
        print(f"  {n_pairs} (right, wrong) pairs over {pair_prompts} prompts: too few for an outcome RM; its arm "
              "picks nothing", flush=True)
    else:
        vlmrl("rm", "train", f"data.pairs.path={pairs}", *common, f"trainer.output_dir={orm}", log=out / "orm.log")
    gold = None
    if args.gold_prm:
        gold = out / "prm_gold"
        vlmrl("rm", "train", f"data.steps.path={gold_steps_file(steps_file, out / 'labels' / 'gold.jsonl', args.format)}",
              *common, f"trainer.output_dir={gold}", log=out / "prm_gold.log")
    result = evaluate(checkpoint, out / "prm", orm, files["test"], args, seed, gold,
                      base if args.rm_sft_steps else None)
    result.update(seed=seed, labelled_answers=len(labelled), labelled_steps=sum(len(r["labels"]) for r in labelled),
                  labelled_right=sum(r["correct"] for r in labelled), orm_pairs=n_pairs,
                  prm_heldout=json.loads((sorted((out / "prm").glob("checkpoint-*"))[-1] / "reward_model.json")
                                         .read_text())["trained"]["heldout"],
                  orm_heldout=None if orm is None else json.loads(
                      (sorted(orm.glob("checkpoint-*"))[-1] / "reward_model.json").read_text())["trained"]["heldout"],
                  wall_seconds=time.perf_counter() - t0)
    return result


def table(result: dict, n: int) -> str:
    sel = result["selection"]
    names = [("single", "one answer (mean@n)"), ("majority", f"majority vote over {n}"),
             ("orm", f"best-of-{n} by the outcome RM"), ("prm", f"best-of-{n} by the PRM (min over steps)"),
             ("prm_vote", f"majority vote weighted by the PRM over {n}"), ("pass", f"pass@{n} (an oracle picks)"),
             ("prm_minus_majority", "PRM - majority (paired)"), ("prm_minus_orm", "PRM - ORM (paired)"),
             ("prm_vote_minus_majority", "PRM-weighted vote - majority (paired)"),
             ("prm_gold", f"best-of-{n} by a PRM on true step labels"),
             ("prm_gold_minus_majority", "true-label PRM - majority (paired)")]
    lines = [f"seed {result['seed']}: {result['prompts']} held-out prompts, {result['answers']} answers", "",
             "| selection | held-out accuracy [95% interval] |", "|---|---|"]
    for key, label in names:
        if key not in sel:
            continue
        v, lo, hi = sel[key]
        sign = "+" if "minus" in key else ""
        lines.append(f"| {label} | {100 * v:{sign}.1f} [{100 * lo:{sign}.1f}, {100 * hi:{sign}.1f}] |")
    if "rm_base" in result:
        own = result["rm_base"]
        lines += ["", "the RMs' starting model answering itself: " + ", ".join(
            f"{label} {100 * own[k][0]:.1f} [{100 * own[k][1]:.1f}, {100 * own[k][2]:.1f}]"
            for k, label in (("single", "one answer"), ("majority", f"majority vote over {n}")))]
    st = result["steps"]
    auc = "" if result.get("step_auc") is None else f"ROC AUC {result['step_auc']:.2f}, "
    lines += ["", f"PRM steps against their true correctness: {auc}accuracy {100 * st['step_accuracy']:.1f}% over "
              f"{st['steps']:.0f} steps ({st['wrong_steps']:.0f} wrong); wrong steps found: precision "
              f"{st['error_precision']:.2f}, recall {st['error_recall']:.2f}, F1 {st['error_f1']:.2f}"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--out", default="runs/prm_digits")
    p.add_argument("--results", default="benchmarks/results/prm_digits.json")
    p.add_argument("--sft", type=int, default=2000, help="labelled rows for the policy's SFT")
    p.add_argument("--sft-steps", type=int, default=1500)
    p.add_argument("--label", type=int, default=2000, help="training prompts whose answers get step labels")
    p.add_argument("--num-digits", type=int, nargs=2, default=[2, 3], metavar=("LOW", "HIGH"),
                   help="digits per image (the task's num_digits): more digits, longer chains, fewer repeated sums")
    p.add_argument("--label-digits", type=int, nargs=2, metavar=("LOW", "HIGH"),
                   help="digits per image of the prompts the RMs learn from (default: --num-digits); with "
                        "--test-digits, RMs trained on short chains judge longer ones (easy-to-hard)")
    p.add_argument("--test-digits", type=int, nargs=2, metavar=("LOW", "HIGH"),
                   help="digits per image of the held-out prompts (default: --num-digits)")
    p.add_argument("--style", choices=["handwritten", "printed"], default="handwritten",
                   help="the task's digits: handwritten (reading is the hard part) or printed (the adding is)")
    p.add_argument("--format", choices=["lines", "running"], default="lines",
                   help="reasoning lines: one digit each, or a running sum (5, 5+4=9, 9+3=12)")
    p.add_argument("--answers", type=int, default=4, help="answers per labelled prompt")
    p.add_argument("--continuations", type=int, default=8)
    p.add_argument("--rm-steps", type=int, default=500)
    p.add_argument("--soft", action="store_true", help="soft step labels (the share of right continuations); "
                   "default: hard (whether any is right), Math-Shepherd's main setting")
    p.add_argument("--gold-prm", action="store_true", help="also a PRM on the same answers' true step labels "
                   "(the ceiling of automatic labels)")
    p.add_argument("--logprob-term", action="store_true", help="every RM (PRM, outcome RM, true-label PRM) with "
                   "model.logprob_term: its own language model's log-prob of what it scores as one more feature")
    p.add_argument("--rm-sft-steps", type=int, default=0, help="start every RM from a stronger model than the "
                   "policy: the same SFT run for this many steps (0: the RMs start from the policy itself). Labels "
                   "still come from the policy's own answers")
    p.add_argument("--completer", choices=["policy", "rm-base"], default="policy",
                   help="which model continues each step to label it (Math-Shepherd's completer): the policy, or the "
                   "RMs' stronger starting model (--rm-sft-steps); the answers labelled are the policy's either way")
    p.add_argument("--reuse", action="store_true", help="reuse the policy and RM-base checkpoints already in --out "
                   "(same seed and settings) instead of training them again; the labels and RMs are always made anew")
    p.add_argument("--test", type=int, default=300, help="held-out prompts")
    p.add_argument("--n", type=int, default=8, help="answers per held-out prompt (best-of-n)")
    p.add_argument("--max-new-tokens", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="seconds: a very small model and a few of everything")
    p.add_argument("overrides", nargs="*", help="more `vlmrl train` overrides for the policy")
    args = p.parse_args()
    if args.smoke:
        args.seeds, args.overrides = args.seeds[:1], [*TINY_MODEL, *args.overrides]
        args.sft, args.sft_steps, args.label, args.answers, args.continuations = 16, 150, 6, 2, 2
        args.rm_steps, args.test, args.n, args.threads = 2, 4, 2, 1
    results = []
    for seed in args.seeds:
        print(f"seed {seed}", flush=True)
        results.append(run_seed(seed, args, Path(args.out)))
        print(table(results[-1], args.n), flush=True)
    if args.results:
        Path(args.results).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
