"""The LoRA base-drift check of benchmarks/gpu_check.py: push a LoRA policy's weights into a vLLM engine (or a
recording stand-in for `vllm.LLM`) many times and measure how far any base weight moved (it must not move at all:
merged weights are built out of place)."""

from __future__ import annotations

import math
import re
import time

LORA_R = 16  # adapter rank of the check and of the LoRA training cases


class RecordingLLM:
    """Stands in for `vllm.LLM` where vLLM cannot run: `collective_rpc(fn)` calls `fn` on a worker whose model's
    `load_weights` consumes the pushed (name, tensor) stream the way vLLM's does and records names, shapes and dtypes
    (a worker without `reload_weights`, as before vLLM 0.32); sleeping, waking and the cache resets are no-ops."""

    def __init__(self):
        self.loads: list[list[tuple[str, tuple, str]]] = []
        self.model = self
        self.model_runner = self  # the worker, its model runner and its model, all in one

    def collective_rpc(self, method, args=()):
        return [method(self, *args)]

    def get_model(self):
        return self

    def modules(self):  # no tied head to re-pack
        return iter(())

    def load_weights(self, weights) -> set[str]:
        record = []
        for name, tensor in weights:
            record.append((name, tuple(tensor.shape), str(tensor.dtype)))
        self.loads.append(record)
        return {name for name, _, _ in record}

    def sleep(self, level: int = 1) -> None: ...
    def wake_up(self, tags=None) -> None: ...

    def reset_prefix_cache(self) -> bool:
        return True

    def reset_encoder_cache(self) -> None: ...
    def reset_mm_cache(self) -> None: ...


def standin_engine(device: str):
    """A `VLLMEngine` whose `llm` is a `RecordingLLM` (made without __init__, which starts vLLM)."""
    from concurrent.futures import ThreadPoolExecutor

    from vlmrl.rollout.vllm_engine import DEFAULTS, VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.options = {**DEFAULTS, "sleep": False}
    engine._thread = ThreadPoolExecutor(1, thread_name_prefix="vllm-engine")
    engine.asleep = False
    engine.device = device
    engine.llm = RecordingLLM()
    return engine


def base_name(name: str) -> str:
    """A PEFT parameter name as the base model names it (`base_model.model.x.base_layer.weight` -> `x.weight`)."""
    name = name.removeprefix("base_model.model.")
    return re.sub(r"\.(?:base_layer|modules_to_save\.[^.]+)(?=\.)", "", name)


def snapshot_base(model) -> dict:
    """A copy of every base (non-adapter) parameter, under its PEFT name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}


def max_drift(snapshot: dict, model) -> float:
    """The largest |now - before| over the base parameters of `snapshot`; inf if one is missing or changed shape."""
    params = dict(model.named_parameters())
    worst = 0.0
    for name, before in snapshot.items():
        now = params.get(name)
        if now is None or now.shape != before.shape:
            return math.inf
        now = now.detach()
        if not now.equal(before):
            d = float((now.float() - before.float()).abs().max())
            worst = max(worst, d if math.isfinite(d) and d > 0 else math.inf)  # unequal with no finite gap: NaNs
    return worst


def randomize_lora_b(model, std: float = 0.02, seed: int = 0) -> int:
    """Give every LoRA B a random non-zero value (PEFT starts B at 0, which would make merged = base); returns the
    number of LoRA layers."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    layers = 0
    with torch.no_grad():
        for module in model.modules():
            lora_b = getattr(module, "lora_B", None)
            if isinstance(lora_b, torch.nn.ModuleDict) and len(lora_b):
                layers += 1
                for linear in lora_b.values():
                    w = linear.weight
                    w.copy_((torch.randn(w.shape, generator=gen) * std).to(w.dtype))
    return layers


def drift_check(policy, engine, pushes: int) -> dict:
    """Push the policy's weights `pushes` times through `engine.push_weights`; report the base weights' drift.

    The pushed stream is watched on its way through `engine._load` (where push_weights hands it to vLLM): tensors
    per push, and on the first push how many differ from the base weight of the same name (the merged LoRA layers)."""
    import torch

    snapshot = snapshot_base(policy.model)
    by_base_name = {base_name(n): t for n, t in snapshot.items()}
    seen = {"count": 0, "changed": 0, "first": True}
    original_load = engine._load

    def watched_load(weights):
        def stream():
            for name, tensor in weights:
                seen["count"] += 1
                if seen["first"]:
                    base = by_base_name.get(name)
                    if base is not None and (base.shape != tensor.shape or not base.equal(tensor.to(base.dtype))):
                        seen["changed"] += 1
                yield name, tensor
        return original_load(stream())

    engine._load = watched_load
    per_push, drift_first, problems = [], None, []
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(pushes):
            before = seen["count"]
            returned = engine.push_weights(policy)
            recorded = engine.llm.loads[-1] if isinstance(engine.llm, RecordingLLM) and engine.llm.loads else None
            n = seen["count"] - before or (len(recorded) if recorded is not None else 0) or \
                (returned if isinstance(returned, int) else 0)
            per_push.append(n)
            seen["first"] = False
            if i == 0:
                drift_first = max_drift(snapshot, policy.model)
    seconds = time.perf_counter() - start
    drift = max_drift(snapshot, policy.model) if pushes else None
    merged_left = sum(1 for m in policy.model.modules() if getattr(m, "merged", False))
    if pushes and drift != 0.0:
        problems.append(f"base weights drifted by {drift:.3g} over {pushes} pushes (after the first: {drift_first:.3g})")
    if pushes and min(per_push) <= 0:
        problems.append(f"a push sent no tensors (per push: {sorted(set(per_push))})")
    if pushes and seen["changed"] == 0:
        problems.append("no pushed tensor differs from its base weight: the LoRA adapters did not reach the engine")
    if merged_left:
        problems.append(f"{merged_left} LoRA layers left merged after the pushes")
    return {"pushes": pushes, "tensors_per_push": per_push[0] if per_push else 0, "tensors_pushed": sum(per_push),
            "pushed_changed": seen["changed"], "max_abs_drift": drift, "drift_after_first_push": drift_first,
            "lora_layers_left_merged": merged_left, "seconds": round(seconds, 2), "problems": problems}


def run_drift(args, model_info: dict, vllm_version: str | None) -> dict:
    """The drift check on `model_info`'s folder: bf16 weights on the device, LoRA r=16 with random B."""
    out = {"status": "pending", "model": model_info["name"], "reason": None, "error": None, "problems": []}
    if args.pushes <= 0:
        return {**out, "status": "skipped", "reason": "--pushes 0"}
    try:
        import torch

        from vlmrl.config import LoraConfig
        from vlmrl.models.policy import load_policy
        from vlmrl.models.trainable import add_lora

        device = "cuda:0" if args.device == "cuda" else args.device
        policy = load_policy(model_info["folder"], "bfloat16", device)
        policy = add_lora(policy, LoraConfig(r=LORA_R), model_info["folder"])
        out["lora_layers"] = randomize_lora_b(policy.model)
        if vllm_version is not None and device.startswith("cuda"):
            from vlmrl.rollout.vllm_engine import VLLMEngine

            engine = VLLMEngine(model_info["folder"], {"sleep": False, "gpu_memory_utilization": 0.25}, seed=0,
                                device=device)
            out["engine"] = f"vllm {vllm_version}"
        else:
            engine = standin_engine(device)
            out["engine"] = "stand-in (RecordingLLM)"
        out.update(drift_check(policy, engine, args.pushes))
        del policy, engine
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    except Exception as e:  # recorded, like a failed training case
        import traceback

        out["problems"].append(f"{type(e).__name__}: {e}")
        out["traceback"] = traceback.format_exc()[-4000:]
    out["status"] = "failed" if out["problems"] else "ok"
    out["error"] = out["problems"][0] if out["problems"] else None
    return out
