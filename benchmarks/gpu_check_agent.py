"""The agent check of benchmarks/gpu_check.py: the zoom agent on vLLM against the built-in sampler, turn by turn, and
a repeated image after a push of vision weights. It runs as a process of its own (vLLM's memory and process group go
with it); gpu_check.py starts it where `import vllm` works and reads its JSON:

    python benchmarks/gpu_check_agent.py --model FOLDER --out agent.json [--device cuda] [--max-gap-mean 0.1]

1. The zoom agent, per turn. BOARDS zoom_shape boards x GROUP trajectories x up to 3 turns of TURN_TOKENS tokens,
   sampled once on vLLM (`VLLMEngine` + `vlmrl.agent.agent_rollout`, what rollout.engine=vllm runs) and once on the
   built-in sampler, from the same weights and seeds; the training forward then scores each arm's trajectories and
   the gap |sampler log-prob - training log-prob| is reported per turn (mean, max, tokens). ok: every turn's vLLM
   mean <= --max-gap-mean (0.1), and some trajectory sampled a third turn after two image observations. The model
   has random weights, which never write a tool call and rarely end a turn, so the environment replays the board's
   demonstrated zoom (the real `zoom` tool on the blue cell; the observation is the zoomed image) whatever the
   message says, and a turn ends at any of END_SHARE of the ordinary vocabulary as well as at the end-of-turn token
   (on both arms alike), so trajectories reach their later turns.
2. A repeated image after a push. One board, MOVE_TOKENS tokens from a fixed seed on vLLM; noise on the projector's
   weights (text weights unchanged), `push_weights` (which resets the engine's prefix, encoder and multimodal
   caches); the same board and seed again. ok: under the training forward the push moved that answer's log-probs
   by at least --min-move (mean), and vLLM's log-probs after the push are the training forward's under the new
   weights (mean gap <= --max-gap-mean). An encoder cache kept across the push would answer with the old image
   features: a gap about as large as the move.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

from gpu_check_child import run_child  # benchmarks/ is on the path: these run as scripts

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BOARDS, GROUP, TURNS, TURN_TOKENS, MOVE_TOKENS = 8, 4, 3, 32, 16
END_SHARE = 0.05  # of the ordinary vocabulary: a random-weight turn then ends after ~20 tokens
PIXELS = 448 * 448  # the training cases' image budget (256 image tokens)


def end_tokens(policy, share: float = END_SHARE) -> list[int]:
    """The policy's end tokens and every round(1 / share)-th ordinary (non-special) token id."""
    tok = policy.processor.tokenizer
    special = set(tok.all_special_ids) | {policy.processor.image_token_id}
    step = max(int(round(1 / share)), 1)
    extra = [i for i in range(0, len(tok), step) if i not in special]
    return list(dict.fromkeys([*policy.eos_token_ids, *extra]))


class DemoZoom:
    """The zoom environment whatever the policy writes: each turn runs the board's demonstrated zoom call (the
    blue cell of the board, image 0) through the real tool, so every observation is a zoomed image."""

    def __init__(self, sample, tools, context):
        from vlmrl.agent.env import ToolEnvironment
        from vlmrl.agent.tools import parse_calls

        call = json.loads(parse_calls(sample["demonstration"][0])[0])
        call["arguments"]["image"] = 0  # the board, not the previous turn's zoom
        self.env, self.call = ToolEnvironment(sample, tools, context), f"<tool_call>{json.dumps(call)}</tool_call>"

    def step(self, message: str):
        return self.env.step(self.call)


def trainer_logprobs(policy, prompts, rollout, temperature: float = 1.0):
    """The training forward's log-probs of the rollout's tokens (its own conversations for multi-turn rows)."""
    import torch

    from vlmrl.models.scoring import score_batch

    device = policy.family.device
    batch, index = rollout.scoring_inputs(prompts)
    with torch.no_grad(), policy.sampling():
        out = score_batch(policy, batch, index.to(device), rollout.completion_ids.to(device),
                          rollout.completion_mask.to(device), temperature, micro_batch=4)
    return out.logprobs.float().cpu()


def turn_gaps(rollout, trained) -> list[dict]:
    """Per turn k (the k-th run of policy tokens in each row): mean and max |sampler - trainer| and the tokens."""
    sums: dict[int, list[float]] = {}
    mask, sampled = rollout.completion_mask.cpu(), rollout.logprobs.float().cpu()
    for row in range(mask.shape[0]):
        turn, previous = -1, 0
        for t, m in enumerate(mask[row].tolist()):
            if m and not previous:
                turn += 1
            if m:
                sums.setdefault(turn, []).append(abs(float(sampled[row, t]) - float(trained[row, t])))
            previous = m
    return [{"turn": k, "tokens": len(v), "gap_mean": sum(v) / len(v), "gap_max": max(v)}
            for k, v in sorted(sums.items())]


def agent_arm(policy, samples, engine, seeds) -> dict:
    """One arm of the zoom agent (engine None: the built-in sampler): its per-turn gaps and trajectory shapes."""
    from vlmrl.agent import AgentLimits, agent_rollout
    from vlmrl.agent.tools import BUILTIN_TOOLS
    from vlmrl.rollout.batch import make_prompts

    prompts = make_prompts(policy, samples)
    limits = AgentLimits(max_turns=TURNS, turn_tokens=TURN_TOKENS, max_total_tokens=2048, max_images=TURNS - 1)
    start = time.perf_counter()
    with policy.sampling():
        out = agent_rollout(policy, prompts, samples, GROUP, limits, {"zoom": BUILTIN_TOOLS["zoom"]}, DemoZoom, 1.0,
                            prompt_seeds=seeds, max_pixels=policy.processor.max_image_pixels(), engine=engine)
    seconds = time.perf_counter() - start
    turns = out.rollout.columns["num_turns"]
    gaps = turn_gaps(out.rollout, trainer_logprobs(policy, prompts, out.rollout))
    return {"per_turn": gaps, "trajectories": len(turns), "reached_turn": [sum(n > k for n in turns)
                                                                            for k in range(TURNS)],
            "images_per_trajectory": sum(len(e.images) for e in out.episodes) / max(len(turns), 1),
            "seconds": round(seconds, 2)}


def agent_problems(result: dict, max_gap_mean: float) -> list[str]:
    problems = []
    for turn in result["per_turn"]:
        if not turn["gap_mean"] <= max_gap_mean:
            problems.append(f"turn {turn['turn']}: log-prob gap mean {turn['gap_mean']:.3g} > {max_gap_mean}")
    if len(result["per_turn"]) < TURNS:
        problems.append(f"no trajectory sampled turn {len(result['per_turn'])} (reached: {result['reached_turn']})")
    return problems


def image_push_case(policy, sample, sample_fn, push_fn, max_gap_mean: float, min_move: float, seed: int = 7) -> dict:
    """The repeated image after a push of projector weights (module docstring, 2). `sample_fn(prompts, samples,
    seed)`: the engine's rollout; `push_fn()`: the push."""
    import torch

    from vlmrl.rollout.batch import make_prompts

    prompts = make_prompts(policy, [sample])
    before = sample_fn(prompts, [sample], seed)
    gap_before = (before.logprobs - trainer_logprobs(policy, prompts, before)).abs()[before.completion_mask.bool()]
    prefixes = policy.family.projector_prefixes
    params = {n: p for n, p in policy.model.named_parameters() if n.startswith(prefixes)}
    old = {n: p.detach().clone() for n, p in params.items()}
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for p in params.values():
            noise = torch.randn(p.shape, generator=gen) * float(p.float().std() if p.numel() > 1 else 0.02)
            p.add_(noise.to(p.device, p.dtype))
    push_fn()
    after = sample_fn(prompts, [sample], seed)
    mask = after.completion_mask.bool()
    new = trainer_logprobs(policy, prompts, after)
    pushed = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():  # the old weights, for how far the push moved this answer
            p.copy_(old[n])
    stale = trainer_logprobs(policy, prompts, after)
    with torch.no_grad():
        for n, p in params.items():  # the pushed weights again: the policy is what the engine holds
            p.copy_(pushed[n])
    moved = (new - stale).abs()[mask]
    gap = (after.logprobs - new).abs()[mask]
    result = {"tokens": int(mask.sum()), "projector_tensors": len(params),
              "gap_before_push_mean": float(gap_before.mean()), "move_mean": float(moved.mean()),
              "gap_after_push_mean": float(gap.mean()), "gap_after_push_max": float(gap.max()),
              "gap_to_old_weights_mean": float((after.logprobs - stale).abs()[mask].mean())}
    problems = []
    if not result["move_mean"] >= min_move:
        problems.append(f"the push moved the repeated image's log-probs by {result['move_mean']:.3g} < {min_move} "
                        "(--min-move): the case shows nothing")
    if not result["gap_after_push_mean"] <= max_gap_mean:
        problems.append(f"after the push the engine's log-probs are {result['gap_after_push_mean']:.3g} from the "
                        f"training forward's (> {max_gap_mean}); to the old weights' {result['gap_to_old_weights_mean']:.3g}")
    result["problems"] = problems
    return result


def run(model: str, device: str, max_gap_mean: float, min_move: float) -> dict:
    """Both parts on `model` (a gpu_check model folder): bf16, full fine-tuning (the vision tower trains)."""
    from vlmrl.data import make_task
    from vlmrl.rollout.vllm_engine import VLLMEngine

    out: dict = {"problems": []}
    policy = load_for_check(model, device)
    engine = VLLMEngine(model, {"gpu_memory_utilization": 0.3, "max_model_len": 4096, "enforce_eager": True,
                                "dtype": "bfloat16"}, seed=0, device=device)
    engine.push_weights(policy)  # (the folder's weights; the policy's end tokens are the check's)
    samples = make_task("zoom_shape", BOARDS, "train", seed=0)
    seeds = [1000 + i for i in range(BOARDS)]
    out["vllm"] = agent_arm(policy, samples, engine, seeds)
    out["hf"] = agent_arm(policy, samples, None, seeds)
    out["problems"] += [f"vllm {p}" for p in agent_problems(out["vllm"], max_gap_mean)]
    out["problems"] += [f"hf {p}" for p in agent_problems(out["hf"], max_gap_mean)]

    def sample_fn(prompts, chunk, seed):
        return engine.generate(policy, prompts, chunk, 1, MOVE_TOKENS, 1.0, 0, 1.0, [seed])

    out["image_push"] = image_push_case(policy, samples[0], sample_fn, lambda: engine.push_weights(policy),
                                        max_gap_mean, min_move)
    out["problems"] += out["image_push"].pop("problems")
    return out


def load_for_check(model: str, device: str):
    from vlmrl.models.policy import load_policy

    policy = load_policy(model, "bfloat16", device, min_pixels=PIXELS, max_pixels=PIXELS)
    policy.eos_token_ids = end_tokens(policy)
    return policy


def skip_reason(args, vllm_error: str | None) -> str | None:
    """Why gpu_check.py cannot run this check here, or None."""
    if not args.device.startswith("cuda"):
        return "vLLM runs on CUDA only (--device cpu)"
    if "vllm" not in args.engines:
        return "--engines without vllm"
    return vllm_error


def run_agent_check(args, model_info: dict, work: Path, left: float | None, run_process, env: dict) -> dict:
    """gpu_check.py's job: this file as its own process (`run_process(cmd, log, timeout, env)`, gpu_check's), its
    JSON read back into the report's `agent` entry."""

    out = {"status": "pending", "model": model_info["name"], "reason": None, "error": None, "problems": []}
    result_path, log = work / "agent_check.json", work / "logs" / "agent_check.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--model", model_info["folder"], "--out", str(result_path),
           "--device", "cuda:0", "--max-gap-mean", str(args.max_gap_mean)]
    return run_child(cmd, out, result_path, log, left, run_process, env)


def agent_lines(a: dict | None) -> list[str]:
    """The check's lines in gpu_check's table: the per-turn gaps of both arms and the repeated image."""
    if not a:
        return []
    if a["status"] == "skipped":
        return ["", f"agent check: skipped ({a['reason']})"]
    lines = ["", f"agent check ({a['model']}): {a['status']}" + (f"; {a['error']}" if a.get("error") else "")]
    for arm, name in (("vllm", "zoom agent on vLLM"), ("hf", "zoom agent, built-in sampler")):
        if a.get(arm):
            turns = ", ".join(f"turn {t['turn']}: {t['gap_mean']:.2e} ({t['tokens']} tokens)"
                              for t in a[arm]["per_turn"])
            lines.append(f"  {name}: gap mean per turn {turns}")
    push = a.get("image_push")
    if push:
        lines.append(f"  repeated image after a projector push: moved {push['move_mean']:.3g}, engine gap "
                     f"{push['gap_after_push_mean']:.2e} (to the old weights {push['gap_to_old_weights_mean']:.3g})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_check_agent.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model folder (gpu_check.py writes them)")
    p.add_argument("--out", required=True, help="the JSON result")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--max-gap-mean", type=float, default=0.1)
    p.add_argument("--min-move", type=float, default=0.1)
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        result = run(args.model, args.device, args.max_gap_mean, args.min_move)
    except Exception as e:  # recorded, like a failed training case
        result = {"problems": [f"{type(e).__name__}: {e}"], "traceback": traceback.format_exc()[-4000:]}
    result["seconds"] = round(time.perf_counter() - start, 1)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "traceback"}, default=str)[:4000])
    return 0 if not result["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
