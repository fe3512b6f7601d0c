"""A generative reward model made with vlmrl, end to end: train a judge, serve it, train a retriever with it.

1. `vlmrl reclip grm-data`: judged retrievals of the built-in scenes (the programmatic judge's replies) as data files;
2. `vlmrl train recipes/reclip_grm.yaml`: the tiny VLM learns to judge (SFT, then RL paid by agreement);
3. `vlmrl serve` of that run, as an OpenAI-compatible endpoint;
4. `vlmrl reclip grm-eval`: its verdict agreement and reason precision / recall against the programmatic judge on
   held-out retrievals (scenes whose captions were never seen in training), through the endpoint;
5. `benchmarks/reclip_vs_infonce.py --arms reclip reclip_learned_judge ...`: ReCLIP with the programmatic judge
   against ReCLIP with the served one, same warm-start, same batches, equal steps.

    python benchmarks/reclip_grm.py --out runs/reclip-grm --seeds 0 1          # ~1 h on 2 cores
    python benchmarks/reclip_grm.py --out /tmp/g --smoke                        # every stage, tiny (slow test)

Prints the agreement table and the arms' table; every number goes to OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def run(*args: str, log: Path) -> None:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(list(args), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"{' '.join(args[:4])} failed ({done.returncode}); see {log}")
    print(f"  {' '.join(a for a in args[1:5] if not a.startswith('/'))}: {time.perf_counter() - t0:.0f} s", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(run_dir: Path, port: int, log: Path) -> subprocess.Popen:
    """`vlmrl serve RUN_DIR` in the background, returned once /healthz answers."""
    proc = subprocess.Popen([PY, "-m", "vlmrl", "serve", str(run_dir), "--port", str(port), "--model-name",
                             "reclip_grm", "--max-batch", "64", "--max-queue", "256", "--threads", "1"],
                            cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"vlmrl serve exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    sys.exit(f"vlmrl serve did not answer /healthz in 300 s; see {log}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/reclip-grm")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="ReCLIP seeds (the judge is trained once)")
    p.add_argument("--train-rows", type=int, default=8000)
    p.add_argument("--grm", nargs="*", default=[], help="overrides of recipes/reclip_grm.yaml (e.g. trainer.steps=0)")
    p.add_argument("--reclip", nargs="*", default=[], help="overrides of the ReCLIP arms (e.g. rl.steps=100)")
    p.add_argument("--eval-n", type=int, default=500, help="held-out retrievals the agreement is measured on")
    p.add_argument("--smoke", action="store_true", help="every stage, as small as it runs (the slow test)")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    grm, reclip, rows, eval_n = args.grm, args.reclip, args.train_rows, args.eval_n
    if args.smoke:
        rows, eval_n = 200, 40
        grm = ["sft.steps=150", "trainer.steps=2", "trainer.eval_every=0", "data.eval.n=20", "model.tiny.hidden_size=96",
               "model.tiny.num_layers=2", "model.tiny.intermediate_size=256", *grm]
        reclip = ["warmup.steps=5", "rl.steps=2", "data.train.n=200", "data.eval.n=60", "rl.batch_size=16",
                  "rl.candidates=8", *reclip]
    data = out / "data"
    t0 = time.perf_counter()
    print("1. judged retrievals", flush=True)
    run(PY, "-m", "vlmrl", "reclip", "grm-data", str(data), "--train", str(rows), "--eval", "300",
        log=out / "grm_data.log")
    print("2. the judge learns (SFT, then RL with the programmatic judge as its reward)", flush=True)
    run(PY, "-m", "vlmrl", "train", "recipes/reclip_grm.yaml", f"data.train.path={data}/train.jsonl",
        f"data.sft.path={data}/train.jsonl", f"data.eval.path={data}/eval.jsonl", f"trainer.output_dir={out}/grm",
        *grm, log=out / "grm_train.log")
    t_judge = time.perf_counter() - t0
    port = free_port()
    print(f"3. vlmrl serve on port {port}", flush=True)
    server = serve(out / "grm", port, out / "serve.log")
    url = f"http://127.0.0.1:{port}/v1"
    try:
        print("4. agreement with the programmatic judge on held-out retrievals", flush=True)
        run(PY, "-m", "vlmrl", "reclip", "grm-eval", "--base-url", url, "--model", "reclip_grm", "--n", str(eval_n),
            "--out", str(out / "agreement.json"), log=out / "grm_eval.log")
        print((out / "grm_eval.log").read_text())
        print("5. ReCLIP: the programmatic judge against the learned one", flush=True)
        run(PY, "benchmarks/reclip_vs_infonce.py", *reclip, "--seeds", *map(str, args.seeds), "--arms", "reclip",
            "reclip_learned_judge", "--grm-url", url, "--out", str(out / "reclip" / "results.json"),
            log=out / "reclip.log")
    finally:
        server.terminate()
        server.wait(30)
    log = (out / "reclip.log").read_text()
    print(log[log.find("| held-out metric"):])
    results = {"agreement": json.loads((out / "agreement.json").read_text()),
               "reclip": json.loads((out / "reclip" / "results.json").read_text()),
               "grm_overrides": grm, "reclip_overrides": reclip, "judge_seconds": t_judge,
               "seconds": time.perf_counter() - t0}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out / 'results.json'} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
