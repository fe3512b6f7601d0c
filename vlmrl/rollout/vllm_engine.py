"""Stage I on vLLM (optional, for GPUs): the same prompts, G answers each, from a colocated vLLM engine.

`rollout.engine: vllm` replaces the built-in sampler (vlmrl/rollout/generate.py) with a `vllm.LLM` living in each
training process (`distributed_executor_backend="external_launcher"`, as TRL's colocate mode), fed by the same
preprocessing path as training:

- the prompt token ids are the training processor's (images already expanded to their placeholder tokens), and the
  PIL images are the samples' own, with the processor's pixel budget (`image_processor.size`, see `_image_budget`)
  passed as `mm_processor_kwargs` {"min_pixels", "max_pixels"}; vLLM checks that its image features fill exactly
  those placeholders;
- one request per prompt with `n = G` and the prompt's own seed (`prompt_seed`), so a step samples the same answers
  however prompts are sharded;
- each sampled token's log-prob, `logprobs_mode="processed_logprobs"` (see "Log-probs" below).

Process group: the external launcher reads RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Under torchrun
they are torchrun's; in a plain single process (`vlmrl train rollout.engine=vllm` on one GPU) `launcher_env` sets a
world of one (RANK=0, WORLD_SIZE=1, LOCAL_RANK=0 or the index of `device`, 127.0.0.1 and a free port). vLLM puts its
worker on `cuda:LOCAL_RANK`; an explicit `device` must name that GPU.

Weights: after every optimizer step `push_weights` hands vLLM the trainable parameters only (the frozen ones were
loaded from the checkpoint vLLM started from), under the base model's parameter names. Under LoRA nothing in the
policy is written: for every adapted layer the merged weight W + sum over active adapters of scaling * B @ A is built
out of place, in float32, then cast to W's dtype, and pushed in W's place (merging into W and unmerging again would
drift W by a rounding error at every push in bf16, and W is also the KL reference). The merged tensors go to vLLM's
`load_weights` as an iterator, made one at a time as it consumes them, not all held at once.

Memory: the engine sleeps (level 1: weights offloaded to CPU memory, KV cache freed) except while `generate` samples
and `push_weights` loads weights, so training and evaluation get the GPU memory back.

Log-probs: vLLM offers raw log-probs (before any logits processing, so before temperature) or processed ones (after
temperature *and* top-k/top-p, renormalised over the kept tokens); none sits between. vlmrl's sampler and training
score tokens under the unfiltered tempered distribution softmax(logits / T). `processed_logprobs` is the same thing
when top_k = 0 and top_p = 1 (the defaults); with a filter on, the engine's log-prob of a sampled token is higher by
-log(kept probability mass). The engine's log-probs are only a logged diagnostic: the training forward's own
log-probs are the old log-probs, and each step logs their difference to the engine's (`rollout/logprob_gap_max`,
`rollout/logprob_gap_mean`). Without top-k/top-p that gap measures the kernel and precision differences between vLLM
and the training forward (and would show weights that failed to arrive); with a filter on it also contains that
renormalisation term, so it is no longer a pure consistency check.

vLLM is not a dependency: `pip install 'vlmrl[vllm]'` on a CUDA machine. Its CPU build runs Qwen2-VL only where a
CPU torchvision is installed (docs/scaling.md).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vlmrl.errors import ConfigError
from vlmrl.models.batch import PromptBatch
from vlmrl.models.policy import Policy
from vlmrl.rollout.generate import Rollout

DEFAULTS: dict[str, Any] = {
    "gpu_memory_utilization": 0.3,  # vLLM's share of the GPU; the rest stays with training
    "max_model_len": 4096,
    "enforce_eager": False,
    "sleep": True,  # sleep (level 1) between generation and training
    "dtype": "auto",
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


def _hf_name(name: str) -> str:
    """A PEFT parameter name as the base model names it: `base_model.model.x.base_layer.weight` -> `x.weight`,
    `base_model.model.x.modules_to_save.default.weight` -> `x.weight`."""
    name = name.removeprefix("base_model.model.")
    return re.sub(r"\.(?:base_layer|modules_to_save\.[^.]+)(?=\.)", "", name)


def _is_lora_layer(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("base_layer", "lora_A", "lora_B", "scaling", "active_adapters"))


def _lora_delta(layer: nn.Module, weight: Tensor) -> Tensor | None:
    """sum over the layer's active adapters of scaling * B @ A (transposed for fan_in_fan_out), in float32; None when
    the adapters are disabled or none is on this layer."""
    if getattr(layer, "disable_adapters", False):
        return None
    if getattr(layer, "merged", False):
        raise RuntimeError("push_weights: a LoRA layer has its adapters merged into its base weight; the merged weight "
                           "is built out of place, the base must stay the unmerged one")
    delta = None
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        if getattr(layer, "use_dora", {}).get(name) or getattr(layer, "lora_bias", {}).get(name):
            raise NotImplementedError("push_weights merges plain LoRA only (no DoRA, no lora_bias)")
        d = (layer.lora_B[name].weight.float() @ layer.lora_A[name].weight.float()) * layer.scaling[name]
        d = d.T if getattr(layer, "fan_in_fan_out", False) else d
        delta = d.to(weight.device) if delta is None else delta + d.to(weight.device)
    return delta


@torch.no_grad()
def weights_to_push(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(base-model name, tensor) of what vLLM needs after an update, one at a time: every LoRA layer's merged weight
    (W + delta computed in float32, cast to W's dtype; W itself untouched), then every other trainable parameter
    (full fine-tuning: all of them; under LoRA e.g. `modules_to_save`). Adapter parameters are never pushed."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    pushed = set()
    for module in model.modules():
        if not _is_lora_layer(module):
            continue
        weight = module.get_base_layer().weight if hasattr(module, "get_base_layer") else module.base_layer.weight
        delta = _lora_delta(module, weight)
        merged = weight.detach() if delta is None else (weight.float() + delta).to(weight.dtype)
        name = _hf_name(names[id(weight)])
        pushed.add(name)
        yield name, merged
    for name, p in model.named_parameters():
        if p.requires_grad and ".lora_" not in name and _hf_name(name) not in pushed:
            yield _hf_name(name), p.detach()


class VLLMEngine:
    """A colocated vLLM engine for one training process; see the module docstring.

    `device`: the GPU this process trains on, e.g. "cuda:3" for torchrun's LOCAL_RANK 3 (None: cuda:LOCAL_RANK).
    vLLM places its worker on cuda:LOCAL_RANK, so a device with another index is refused (`launcher_env`)."""

    def __init__(self, model_dir: str | Path, options: dict[str, Any] | None = None, seed: int = 0,
                 device: str | None = None):
        try:
            from vllm import LLM
        except ImportError as error:  # the message says what to do
            raise ImportError("rollout.engine=vllm needs vLLM: pip install 'vlmrl[vllm]' (a CUDA machine), or use "
                              "rollout.engine=hf") from error
        unknown = set(options or {}) - set(DEFAULTS)
        if unknown:
            raise ConfigError(f"rollout.vllm: unknown options {sorted(unknown)}; allowed: {sorted(DEFAULTS)}")
        self.options = {**DEFAULTS, **(options or {})}
        local_rank = launcher_env(device)["LOCAL_RANK"]
        self.device = device or (f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
        o = self.options
        self.llm = LLM(model=str(model_dir), dtype=o["dtype"], gpu_memory_utilization=o["gpu_memory_utilization"],
                       max_model_len=o["max_model_len"], enforce_eager=o["enforce_eager"],
                       enable_sleep_mode=o["sleep"], distributed_executor_backend="external_launcher", seed=seed,
                       logprobs_mode="processed_logprobs")
        self.asleep = False
        self.sleep()

    # -- phases -------------------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        if self.options["sleep"] and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    # -- weights ------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def push_weights(self, policy: Policy) -> int:
        """Load the policy's trainable weights into vLLM (LoRA: the merged weights of adapted layers, built out of
        place; see `weights_to_push`) and go back to sleep; returns how many tensors were pushed. Call with full
        parameters (under FSDP2 inside `gathered(forward)`)."""
        self.wake()
        names: list[str] = []

        def stream() -> Iterator[tuple[str, Tensor]]:
            for name, tensor in weights_to_push(policy.model):
                names.append(name)
                yield name, tensor

        self._load(stream())
        self.llm.reset_prefix_cache()
        self.sleep()
        return len(names)

    def _load(self, weights: Iterator[tuple[str, Tensor]]) -> None:
        self.llm.apply_model(lambda model: model.load_weights(weights))

    # -- generation ---------------------------------------------------------------------------------------------------
    def generate(self, policy: Policy, prompts: PromptBatch, samples: list[dict], group_size: int,
                 max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                 prompt_seeds: list[int]) -> Rollout:
        """G answers per prompt; the same `Rollout` as the built-in sampler."""
        from vllm import SamplingParams

        self.wake()
        budget = _image_budget(policy)
        requests = []
        for p, sample in enumerate(samples):
            ids = prompts.input_ids[p][prompts.attention_mask[p].bool()].tolist()
            request: dict[str, Any] = {"prompt_token_ids": ids}
            if sample.get("images"):
                images = sample["images"]
                request["multi_modal_data"] = {"image": list(images) if len(images) > 1 else images[0]}
                if budget:
                    request["mm_processor_kwargs"] = budget
            requests.append(request)
        params = [SamplingParams(n=group_size, temperature=temperature, top_k=top_k if top_k > 0 else -1,
                                 top_p=top_p, max_tokens=max_new_tokens, seed=int(seed), logprobs=0,
                                 stop_token_ids=list(policy.eos_token_ids), detokenize=False)
                  for seed in prompt_seeds]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        self.sleep()
        return to_rollout(policy, outputs, group_size, max_new_tokens)


def to_rollout(policy: Policy, outputs, group_size: int, max_new_tokens: int) -> Rollout:
    """vLLM's RequestOutputs (one per prompt, G completions each) as a `Rollout`: ids right-padded to
    max_new_tokens, mask 1 on generated tokens (the end token included), sampling log-probs, truncation flags."""
    n = len(outputs) * group_size
    ids = torch.full((n, max_new_tokens), policy.pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, max_new_tokens), dtype=torch.long)
    logps = torch.zeros((n, max_new_tokens))
    truncated = torch.zeros(n, dtype=torch.bool)
    eos = set(policy.eos_token_ids)
    row = 0
    for out in outputs:
        if len(out.outputs) != group_size:
            raise RuntimeError(f"vLLM returned {len(out.outputs)} answers for a prompt, expected {group_size}")
        for completion in out.outputs:
            tokens = list(completion.token_ids)[:max_new_tokens]
            ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, :len(tokens)] = 1
            for t, (token, entry) in enumerate(zip(tokens, completion.logprobs or [], strict=False)):
                logps[row, t] = entry[token].logprob
            truncated[row] = not tokens or tokens[-1] not in eos
            row += 1
    clean = ids.masked_fill(torch.isin(ids, torch.tensor(sorted(eos))), policy.pad_token_id)
    texts = policy.processor.tokenizer.batch_decode(clean, skip_special_tokens=True)
    index = torch.arange(len(outputs)).repeat_interleave(group_size)
    return Rollout(index, ids, mask, logps, truncated, texts)
