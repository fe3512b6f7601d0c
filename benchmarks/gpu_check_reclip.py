"""The ReCLIP check of benchmarks/gpu_check.py: `vlmrl reclip train` on the GPU, in fp32 and under bf16 autocast,
against the same run on the CPU, and under torchrun (ddp and fsdp2) where there are two GPUs. It runs as a process of
its own; gpu_check.py starts it and reads its JSON:

    python benchmarks/gpu_check_reclip.py --device cuda --out reclip.json [--work DIR]
    python benchmarks/gpu_check_reclip.py --device cpu --out reclip.json     # the CPU dry run (tests)

Every arm is the same small job: a random-init CLIP (2-layer towers, 64 wide: a config, no download) on built-in
captioned scenes, WARMUP InfoNCE steps then RL ReCLIP steps with the programmatic judge, the same seed and batches.
ok when:
- fp32 on the device equals fp32 on the CPU: every logged loss within REL (the device's kernels round differently;
  TF32 stays off, vlmrl's default), and the held-out t2i R@1 within one caption of NEAR;
- bf16 (trainer.precision=bf16: the towers under torch.autocast, similarities and losses fp32) trains: every loss
  finite, and the first step's within BF16_REL of fp32's (the same weights, rounded inputs);
- with two or more GPUs, torchrun x2 with trainer.distributed=ddp and =fsdp2 each equal the one-GPU fp32 run within
  REL (the ranks embed other batch shapes), and fsdp2 logged sharded parameters. One GPU: these arms are skipped,
  saying so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from gpu_check_child import run_child  # benchmarks/ is on the path: these run as scripts

ROOT = Path(__file__).resolve().parents[1]
TOWER = "{hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 2}"
VISION = "{hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 2, patch_size: 16}"
WARMUP, RL = 4, 6
JOB = [f"student.config={{model_type: clip, projection_dim: 32, text_config: {TOWER}, vision_config: {VISION}}}",
       "student.name_or_path=config", "student.image_size=64", "data.train.n=64", "data.eval.n=24",
       f"warmup.steps={WARMUP}", "warmup.batch_size=16", f"rl.steps={RL}", "rl.batch_size=16", "rl.candidates=4",
       "rl.selection=sample", "trainer.log_every=1", "trainer.eval_every=0", "trainer.tensorboard=false"]
REL, BF16_REL, NEAR = 2e-3, 0.05, 1 / 24


def run_arm(name: str, work: Path, device: str, nproc: int = 1, *extra: str, timeout: float = 600) -> dict:
    """One `vlmrl reclip train` (under torchrun when nproc > 1); its logged rows and wall time."""
    out = work / name
    launch = (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "vlmrl"]
              if nproc > 1 else ["-m", "vlmrl"])
    cmd = [sys.executable, *launch, "reclip", "train", *JOB, f"student.device={device}",
           f"trainer.output_dir={out}", *extra]
    log = work / f"{name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)})
    arm = {"name": name, "command": cmd, "log": str(log), "exit_code": done.returncode,
           "wall_s": round(time.perf_counter() - t0, 1), "rows": []}
    if done.returncode == 0:
        arm["rows"] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return arm


def losses(arm: dict) -> list[float]:
    return [r["loss"] for r in arm["rows"] if r["phase"] in ("warmup", "train") and "loss" in r]


def final_r1(arm: dict) -> float | None:
    evals = [r for r in arm["rows"] if r["phase"] == "eval" and "t2i/R@1" in r]
    return evals[-1]["t2i/R@1"] if evals else None


def compare(arm: dict, reference: dict, rel: float, label: str) -> list[str]:
    """Problems of `arm` against `reference`: failed, other step counts, a loss off by more than `rel`, R@1 off."""
    if arm["exit_code"] != 0:
        return [f"{arm['name']}: exit code {arm['exit_code']} (see {arm['log']})"]
    a, b = losses(arm), losses(reference)
    if len(a) != len(b) or not a:
        return [f"{arm['name']}: {len(a)} logged losses against {len(b)} for {reference['name']}"]
    worst = max(abs(x - y) / max(abs(y), 1e-6) for x, y in zip(a, b, strict=True))
    arm[f"max_rel_loss_vs_{reference['name']}"] = worst
    problems = [f"{arm['name']}: a loss {worst:.2e} away from {reference['name']}'s (relative; {label} <= {rel:g})"] \
        if worst > rel else []
    r1, ref_r1 = final_r1(arm), final_r1(reference)
    if r1 is None or ref_r1 is None or abs(r1 - ref_r1) > NEAR + 1e-9:
        problems.append(f"{arm['name']}: held-out t2i R@1 {r1} against {ref_r1} for {reference['name']}")
    return problems


def check(device: str, work: Path, gpus: int) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    arms = {"cpu_fp32": run_arm("cpu_fp32", work, "cpu")}
    problems = []
    if arms["cpu_fp32"]["exit_code"] != 0:
        problems.append(f"cpu_fp32: exit code {arms['cpu_fp32']['exit_code']} (see {arms['cpu_fp32']['log']})")
    reference = arms["cpu_fp32"]
    if device != "cpu":
        arms["fp32"] = run_arm("fp32", work, device)
        problems += compare(arms["fp32"], reference, REL, "fp32 on the device against the CPU")
        reference = arms["fp32"]
    arms["bf16"] = run_arm("bf16", work, device, 1, "trainer.precision=bf16")
    bf16 = losses(arms["bf16"])
    if arms["bf16"]["exit_code"] != 0 or not bf16 or not all(math.isfinite(x) for x in bf16):
        problems.append(f"bf16: exit code {arms['bf16']['exit_code']}, losses {bf16[:3]}... (see {arms['bf16']['log']})")
    elif abs(bf16[0] - losses(reference)[0]) > BF16_REL * abs(losses(reference)[0]):
        problems.append(f"bf16: first loss {bf16[0]:.4f} against fp32's {losses(reference)[0]:.4f} (> {BF16_REL:g})")
    skipped = None
    if device == "cpu" or gpus < 2:
        skipped = "torchrun arms need two GPUs" if device != "cpu" else "torchrun arms: the CPU tests run them"
    else:
        for mode in ("ddp", "fsdp2"):
            arm = arms[mode] = run_arm(mode, work, device, 2, f"trainer.distributed={mode}")
            problems += compare(arm, reference, REL, f"torchrun x2 {mode} against one GPU")
        sharded = [r for r in arms["fsdp2"]["rows"] if r["phase"] == "summary"]
        if not sharded or not sharded[0].get("sharded_parameters"):
            problems.append("fsdp2: no sharded parameters logged")
    summary = {name: {"exit_code": a["exit_code"], "wall_s": a["wall_s"], "losses": losses(a), "t2i_R@1": final_r1(a),
                      **{k: v for k, v in a.items() if k.startswith("max_rel_loss")}}
               for name, a in arms.items()}
    return {"status": "failed" if problems else "ok", "device": device, "gpus": gpus, "problems": problems,
            "error": problems[0] if problems else None, "torchrun": skipped or "ran", "arms": summary}


def run_reclip_check(args, work: Path, left: float | None, run_process, env: dict) -> dict:
    """gpu_check.py's job: this file as its own process (`run_process(cmd, log, timeout, env)`, gpu_check's), its
    JSON read back into the report's `reclip` entry."""
    out = {"status": "pending", "reason": None, "error": None, "problems": []}
    result_path, log = work / "reclip_check.json", work / "logs" / "reclip_check.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--device", args.device, "--out", str(result_path),
           "--work", str(work / "reclip_check")]
    return run_child(cmd, out, result_path, log, left, run_process, env)


def reclip_lines(r: dict | None) -> list[str]:
    """The check's lines in gpu_check's table."""
    if not r:
        return []
    if r["status"] == "skipped":
        return ["", f"ReCLIP check: skipped ({r['reason']})"]
    lines = ["", f"ReCLIP check ({r.get('device')}): {r['status']}" + (f"; {r['error']}" if r.get("error") else "")]
    for name, a in (r.get("arms") or {}).items():
        rel = ", ".join(f"{k.removeprefix('max_rel_loss_vs_')} {v:.1e}" for k, v in a.items()
                        if k.startswith("max_rel_loss"))
        lines.append(f"  {name:9s} exit {a['exit_code']}, {a['wall_s']:.0f} s, last loss "
                     f"{a['losses'][-1] if a['losses'] else float('nan'):.4f}, t2i R@1 {a['t2i_R@1']}"
                     + (f", max relative loss gap to {rel}" if rel else ""))
    if r.get("torchrun") and r["torchrun"] != "ran":
        lines.append(f"  torchrun arms: skipped ({r['torchrun']})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_check_reclip.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (cuda:0) or cpu (the dry run)")
    p.add_argument("--out", required=True, help="the JSON result")
    p.add_argument("--work", default=None, help="a folder for the runs and logs (default: beside --out)")
    args = p.parse_args(argv)
    import torch

    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    if args.device.startswith("cuda") and not gpus:
        print("error: --device cuda but torch sees no CUDA device; the dry run is --device cpu", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    result = check(args.device, Path(args.work).resolve() if args.work else out.parent / "reclip_check", gpus)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(reclip_lines(result)))
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
