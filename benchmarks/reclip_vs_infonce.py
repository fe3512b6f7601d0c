"""ReCLIP vs continued InfoNCE from the same warm-start, equal optimizer steps, over seeds.

For each seed: one job (data, embedded student, cached frozen inputs) -> the InfoNCE warm-start -> a snapshot; then
each arm starts from the snapshot (weights, batch order) and runs `rl.steps` optimizer steps of its method on the
same batches: `infonce` (continued symmetric InfoNCE), `reclip` (the recipe's ReCLIP) and, with --arms, `negclip`
(InfoNCE with the hard-negative captions as extra columns: a control that trains on the negatives directly).
Held-out metrics of the warm-start and of every arm are averaged over seeds (mean ± sample std).

    python benchmarks/reclip_vs_infonce.py --seeds 0 1 2 --arms infonce reclip negclip --out runs/reclip-bench/results.json
    python benchmarks/reclip_vs_infonce.py rl.steps=50 warmup.steps=50 --seeds 0     # overrides go first
    python benchmarks/reclip_vs_infonce.py --arms infonce reclip negclip --tables-only A/results.json B/results.json

Prints a markdown table (the one in BENCHMARKS.md) and writes every number to --out.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from vlmrl.reclip.config import load_reclip_config
from vlmrl.reclip.judge import build_judge
from vlmrl.reclip.step import infonce_step
from vlmrl.reclip.trainer import Job, _clamp_scale, _optimizer, prepare, rl_phase, warm_start
from vlmrl.trainer.run import Progress

HEADLINE = ["comp/acc", "t2i/R@1"]
ROWS = ["comp/acc", "comp/relation", "comp/binding", "comp/color", "comp/shape", "comp/count", "comp/all",
        "t2i/R@1", "t2i/R@5", "t2i/R@10", "t2i/semantic_R@1", "i2t/R@1", "i2t/R@5", "i2t/R@10",
        "zeroshot/colour", "zeroshot/shape", "zeroshot/count", "zeroshot/mean"]


GRADED = {"colour": 0.25, "shape": 0.25, "count": 0.25, "relation": 0.25, "missing": 0.5, "extra": 0.5, "other": 0.25}
ZERO = dict.fromkeys(GRADED, 0.0)
EARLIER = {"rl.advantage": "policy", "rl.bank_size": 2000, "judge.penalties": GRADED, "rl.counterfactuals": 0}
# arms beyond the three methods: the recipe's ReCLIP with these overrides of rl.* / judge.* (the ablations; every arm
# spells out the keys the recipe's defaults changed, so an arm means the same whatever the recipe's defaults)
VARIANTS = {
    "reclip_nocf": {"rl.counterfactuals": 0},  # the recipe without its counterfactual captions: the words unused
    "reclip_graded": {"rl.counterfactuals": 0, "judge.penalties": GRADED},  # the words as a scalar penalty only
    "reclip_scalar": EARLIER,  # the earlier default: policy advantages, 2,000-item bank, graded reward
    "reclip_verdict": {**EARLIER, "judge.penalties": ZERO},
    "reclip_cf": {**EARLIER, "rl.counterfactuals": 4},
    "reclip_cf_verdict": {**EARLIER, "rl.counterfactuals": 4, "judge.penalties": ZERO},
    "reclip_log_cf": {"rl.advantage": "log", "rl.bank_size": 2000, "rl.counterfactuals": 4, "judge.penalties": ZERO},
    "reclip_log": {"rl.advantage": "log", "rl.bank_size": 2000, "rl.counterfactuals": 0, "judge.penalties": ZERO},
    "reclip_log_cf_t2ibank": {"rl.advantage": "log", "rl.bank_size": 2000, "rl.counterfactuals": 4,
                              "judge.penalties": ZERO, "rl.bank_directions": ["t2i"]},
    "reclip_log_t2ibank": {"rl.advantage": "log", "rl.bank_size": 2000, "rl.counterfactuals": 0,
                           "judge.penalties": ZERO, "rl.bank_directions": ["t2i"]},
    # the reasons also drawn as scenes: each truth's first 1 (2) counterfactual captions as new images, extra image
    # columns of its caption's text-to-image term (NegCLIP has text negatives only)
    "reclip_cfimg": {"rl.counterfactual_images": 1},
    "reclip_cfimg2": {"rl.counterfactual_images": 2},
    # ... and each drawn scene taught with its own caption as a pair against the truth's, both ways
    "reclip_cfpair2": {"rl.counterfactual_images": 2, "rl.counterfactual_pairs": 1.0},
}
# the recipe's ReCLIP with a judge trained by vlmrl (benchmarks/reclip_grm.py), served at --grm-url
LEARNED_JUDGE = {"model": "reclip_grm", "template": "Ground truth: {reference}\nRetrieved: {prediction}",
                 "max_reasons": 4, "max_tokens": 64, "concurrency": 64, "cache_dir": None}
VARIANTS["reclip_learned_judge"] = {"judge.name": "llm", "judge.options": LEARNED_JUDGE}
ARMS = ["infonce", "reclip", "negclip", *VARIANTS]
DIFFS = [("reclip", "infonce"), ("reclip", "negclip"), ("reclip_learned_judge", "reclip")]  # (arm - base) columns


class Log(Progress):
    def message(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)


def negclip_phase(job: Job) -> dict[str, float]:
    """The control arm: rl.steps of InfoNCE whose text columns include the batch's hard-negative captions."""
    rl, ctx = job.cfg.rl, job.ctx
    ctx.optimizer = _optimizer(job.student, rl.lr)
    ctx.store.warm([n.caption for it in job.train for n in it.negatives])
    for step in range(1, rl.steps + 1):
        metrics = infonce_step(ctx, job.batch(rl.batch_size), negatives=True)
        _clamp_scale(job.student)
        if step % job.cfg.trainer.log_every == 0:
            job.logger.log(metrics, step, "train_negclip")
    result = job.evaluate()
    job.logger.log(result, rl.steps, "eval_negclip")
    return result


def variant(job: Job, arm: str):
    """Point the job's rl / judge settings at `arm`'s (a fresh judgement cache: rewards depend on the penalties);
    returns a function that restores them."""
    rl, judge, scorer = job.cfg.rl, job.cfg.judge, job.ctx.scorer
    changes = VARIANTS.get(arm, {})
    new_rl = dataclasses.replace(rl, **{k[3:]: v for k, v in changes.items() if k.startswith("rl.")})
    new_judge = dataclasses.replace(judge, **{k[6:]: v for k, v in changes.items() if k.startswith("judge.")})
    job.cfg.rl, job.ctx.rl, job.cfg.judge, scorer.cfg = new_rl, new_rl, new_judge, new_judge
    scorer.cache.clear()
    old_judge = scorer.judge
    if (new_judge.name, new_judge.options) != (judge.name, judge.options):
        scorer.judge = build_judge(new_judge.name, new_judge.options)

    def restore():
        job.cfg.rl, job.ctx.rl, job.cfg.judge, scorer.cfg = rl, rl, judge, judge
        scorer.judge = old_judge
        scorer.cache.clear()
    return restore


def run_seed(recipe: str | None, overrides: list[str], seed: int, out_dir: Path, arms: list[str]) -> dict:
    cfg = load_reclip_config(recipe, overrides + [f"trainer.seed={seed}", f"trainer.output_dir={out_dir}/seed{seed}",
                                                  "trainer.save_students=false"])
    t0 = time.perf_counter()
    job = prepare(cfg, Log())
    t_prep = time.perf_counter()
    result = {"seed": seed, "warm": warm_start(job, Log())}
    t_warm = time.perf_counter()
    print(f"seed {seed}: warm-start done ({t_warm - t_prep:.0f} s after {t_prep - t0:.0f} s of setup)", flush=True)
    snapshot = copy.deepcopy(job.student.state_dict())
    batches, candidates = job.batches.get_state(), job.ctx.generator.get_state()
    seconds = {}
    for arm in arms:
        job.student.load_state_dict(snapshot)
        job.batches.set_state(batches)
        job.ctx.generator.set_state(candidates)
        t = time.perf_counter()
        if arm == "negclip":
            result[arm] = negclip_phase(job)
        elif arm in VARIANTS:
            restore = variant(job, arm)
            result[arm] = rl_phase(job, Progress(), "reclip", phase=f"train_{arm}")
            restore()
        else:
            result[arm] = rl_phase(job, Progress(), arm, phase=f"train_{arm}")
        seconds[arm] = time.perf_counter() - t
        print(f"seed {seed}: {arm} done in {seconds[arm]:.0f} s: "
              + ", ".join(f"{k} {100 * result[arm][k]:.1f}" for k in HEADLINE), flush=True)
    result["seconds"] = {"setup": t_prep - t0, "warm": t_warm - t_prep, **seconds}
    job.logger.close()
    return result


def aggregate(results: list[dict], arms: list[str]) -> dict:
    out = {}
    for column in ["warm", *arms]:
        out[column] = {}
        for key in ROWS:
            values = [r[column][key] for r in results if key in r[column]]
            if values:
                out[column][key] = (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0)
    for arm, base in DIFFS:
        if arm in arms and base in arms:
            out[f"{arm}-{base}"] = {}
            for key in ROWS:
                diffs = [r[arm][key] - r[base][key] for r in results if key in r[arm]]
                if diffs:
                    out[f"{arm}-{base}"][key] = (statistics.mean(diffs),
                                                 statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
                                                 sum(d > 0 for d in diffs))
    return out


def markdown(agg: dict, arms: list[str], n: int) -> str:
    names = {"warm": "warm-start", "infonce": "+ InfoNCE", "reclip": "+ ReCLIP", "negclip": "+ NegCLIP (control)",
             **{v: f"+ {v}" for v in VARIANTS}}
    cols = ["warm", *arms]
    diffs = [f"{arm}-{base}" for arm, base in DIFFS if f"{arm}-{base}" in agg]
    heads = {"reclip-infonce": "ReCLIP − InfoNCE (wins)", "reclip-negclip": "ReCLIP − NegCLIP (wins)",
             "reclip_learned_judge-reclip": "learned judge − programmatic (wins)"}
    lines = ["| held-out metric (%) | " + " | ".join([names[c] for c in cols] + [heads[d] for d in diffs]) + " |",
             "|---" * (len(cols) + 1 + len(diffs)) + "|"]
    for key in ROWS:
        if key not in agg["warm"]:
            continue
        cells = [f"{100 * agg[c][key][0]:.1f} ± {100 * agg[c][key][1]:.1f}" for c in cols]
        for name in diffs:
            d, s, wins = agg[name][key]
            cells.append(f"{100 * d:+.1f} ± {100 * s:.1f} ({wins}/{n})")
        bold = key in HEADLINE
        lines.append(f"| {'**' + key + '**' if bold else key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. rl.steps=100")
    p.add_argument("--recipe", default="recipes/reclip_shapes.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=["infonce", "reclip"], choices=ARMS)
    p.add_argument("--out", default="runs/reclip-bench/results.json")
    p.add_argument("--grm-url", default="http://127.0.0.1:8001/v1",
                   help="arm reclip_learned_judge: the served judge's base URL (benchmarks/reclip_grm.py serves one)")
    p.add_argument("--tables-only", nargs="+", metavar="RESULTS_JSON",
                   help="print the table of the seeds in these --out files (e.g. two runs of different seeds)")
    args = p.parse_args()
    if args.tables_only:
        results = [r for f in args.tables_only for r in json.loads(Path(f).read_text())["results"]]
        print(markdown(aggregate(results, args.arms), args.arms, len(results)))
        print(f"\nseeds: {[r['seed'] for r in results]}")
        return
    torch.set_num_threads(1)
    LEARNED_JUDGE["base_url"] = args.grm_url
    overrides = ["trainer.threads=1", *args.overrides]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        results.append(run_seed(args.recipe, overrides, seed, out.parent, args.arms))
        out.write_text(json.dumps({"recipe": args.recipe, "overrides": overrides, "results": results}, indent=2))
    agg = aggregate(results, args.arms)
    out.write_text(json.dumps({"recipe": args.recipe, "overrides": overrides, "results": results,
                               "aggregate": agg}, indent=2))
    print(markdown(agg, args.arms, len(results)))
    secs = [r["seconds"] for r in results]
    print("\nseconds per seed (mean): " + ", ".join(f"{k} {statistics.mean(s[k] for s in secs):.0f}" for k in secs[0]))


if __name__ == "__main__":
    main()
