"""Peak resident memory and seconds per RL step with a real 151,936-token vocabulary, side by side for code versions.

    python benchmarks/vocab_memory.py --code before=/tmp/vlmrl_before --code after=. --tokens 12 48 192
    python benchmarks/vocab_memory.py --code before=/tmp/vlmrl_before --code after=. --quickstart
    python benchmarks/vocab_memory.py --code now=. --smoke          # the smallest mode, a test's

Builds a checkpoint folder laid out like the hub's Qwen2.5-VL-3B-Instruct (`vlmrl.models.hub_fixture`: the real Qwen
tokenizer, chat template and preprocessor config, 151,936-row embedding, ~20M random parameters), then for each code
version (a checkout of vlmrl, put first on PYTHONPATH) and each `rollout.max_new_tokens` runs

    vlmrl train model.name_or_path=FOLDER sft.steps=0 trainer.steps=STEPS rollout.max_new_tokens=T

with the quickstart recipe's rollout (16 x 8 per step; random weights give no group a signal, so dynamic sampling's
fill draw makes one generation call of 7 x 16 prompts x 8 = 896 answers) in a fresh process. Peak RSS is that
process's own (`os.wait4`); seconds per step are the mean of `time/collect_score + time/update` over the steps after
the first. A process is capped at `--limit-gb` of address space, so a run that would not fit fails instead of taking the machine down ("does not fit").
`--quickstart` instead runs the default quickstart shortened to `--quickstart-steps` RL steps (its SFT warm-start in
full) and reports wall time and peak RSS. Versions alternate run by run, so machine noise hits them alike. `--env NAME:KEY=VALUE` sets a variable for one
version's runs, e.g. `--code glibc=. --env glibc:VLMRL_MALLOC_REUSE=0` measures the current code without the
allocator setting of vlmrl/allocator.py.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_train(code: Path, args: list[str], out: Path, limit_gb: float, threads: int, extra_env: dict | None = None
              ) -> dict:
    """One `vlmrl train` in a fresh process on `code`; its peak RSS (GB), wall time and per-step seconds."""
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": str(threads), **(extra_env or {})}

    def cap():
        limit = int(limit_gb * 1024**3)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    cmd = [sys.executable, "-m", "vlmrl", "train", *args, f"trainer.output_dir={out}", f"trainer.threads={threads}"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=cap,
                            cwd=code)
    stderr = proc.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    result = {"peak_rss_gb": usage.ru_maxrss / 1024**2, "wall_s": wall, "ok": os.waitstatus_to_exitcode(status) == 0}
    if not result["ok"]:
        result["error"] = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {status}"
        return result
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("phase") == "train"]
    timed = steps[1:] or steps
    result["step_s"] = sum(r["time/collect_score"] + r["time/update"] for r in timed) / len(timed)
    return result


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--code", action="append", required=True, help="NAME=DIR of a vlmrl checkout (repeatable)")
    p.add_argument("--env", action="append", default=[], help="NAME:KEY=VALUE, an environment variable for the "
                   "runs of code NAME (e.g. after-glibc:VLMRL_MALLOC_REUSE=0)")
    p.add_argument("--tokens", type=int, nargs="+", default=[12, 48, 192], help="rollout.max_new_tokens values")
    p.add_argument("--steps", type=int, default=3, help="RL steps per run (the first is not timed)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--limit-gb", type=float, default=20.0, help="address-space cap of each run")
    p.add_argument("--quickstart", action="store_true", help="the quickstart (shortened) instead of the hub folder")
    p.add_argument("--quickstart-steps", type=int, default=100)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="the smallest mode (tests/test_benchmarks.py): 2 steps of "
                                                        "2 prompts x 2 answers, 12 new tokens, 1 thread")
    a = p.parse_args(argv)
    extra = []  # --smoke: a small batch, no resampling, few prompts (the 151,936-token vocabulary stays)
    if a.smoke:
        a.tokens, a.steps, a.threads, a.quickstart_steps = [12], 2, 1, 2
        extra = ["rollout.prompts_per_step=2", "rollout.group_size=2", "algorithm.dynamic_sampling=false",
                 "data.train.n=32", "data.sft.n=8", "sft.steps=2", "data.eval.n=4", "eval.batch_size=4"]
    codes = [(c.split("=", 1)[0], Path(c.split("=", 1)[1]).resolve()) for c in a.code]
    envs: dict[str, dict] = {}
    for item in a.env:
        name, pair = item.split(":", 1)
        envs.setdefault(name, {})[pair.split("=", 1)[0]] = pair.split("=", 1)[1]
    work = Path(tempfile.mkdtemp(prefix="vocab_memory_"))
    results = []
    if a.quickstart:
        args = [f"trainer.steps={a.quickstart_steps}", "trainer.eval_every=0", "trainer.seed=0", *extra]
        for name, code in codes:
            r = run_train(code, args, work / f"quickstart-{name}", a.limit_gb, a.threads, envs.get(name))
            results.append({"code": name, "run": "quickstart", **r})
            print(json.dumps(results[-1]), flush=True)
        print(f"\nquickstart, {a.quickstart_steps} RL steps, {a.threads} threads")
        print(f"{'code':10s} {'wall s':>8s} {'RL s/step':>10s} {'peak RSS GB':>12s}")
        for r in results:
            print(f"{r['code']:10s} {r['wall_s']:8.1f} {r.get('step_s', float('nan')):10.3f} {r['peak_rss_gb']:12.2f}")
    else:
        sys.path.insert(0, str(ROOT))
        from vlmrl.models.hub_fixture import build_qwen_hub_folder

        folder = build_qwen_hub_folder(work / "Qwen2.5-VL-3B-Instruct-like")
        for tokens in a.tokens:
            for name, code in codes:
                args = [f"model.name_or_path={folder}", "sft.steps=0", f"trainer.steps={a.steps}",
                        f"rollout.max_new_tokens={tokens}", "trainer.eval_every=0", "data.eval.n=16",
                        "eval.batch_size=16", "eval.max_new_tokens=12", "trainer.seed=0", *extra]
                r = run_train(code, args, work / f"{name}-{tokens}", a.limit_gb, a.threads, envs.get(name))
                results.append({"code": name, "max_new_tokens": tokens, **r})
                print(json.dumps(results[-1]), flush=True)
        print(f"\n151,936-token vocabulary, the quickstart's rollout (calls of 112 x 8), {a.threads} threads, "
              f"cap {a.limit_gb:g} GB")
        print(f"{'code':10s} {'new tokens':>10s} {'peak RSS GB':>12s} {'s/step':>8s}")
        for r in results:
            if r["ok"]:
                print(f"{r['code']:10s} {r['max_new_tokens']:10d} {r['peak_rss_gb']:12.2f} {r['step_s']:8.2f}")
            else:
                print(f"{r['code']:10s} {r['max_new_tokens']:10d} {'does not fit':>12s} {'-':>8s}  ({r['error'][:80]})")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
