"""Stage I on vLLM (optional, for GPUs): the same prompts, G answers each, from a colocated vLLM engine.

`rollout.engine: vllm` replaces the built-in sampler (vlmrl/rollout/generate.py) with a `vllm.LLM` living in each
training process (`distributed_executor_backend="external_launcher"`, as TRL's colocate mode), fed by the same
preprocessing path as training:

- the prompt token ids are the training processor's (images already expanded to their placeholder tokens), and the
  PIL images are the samples' own, with the processor's pixel budget passed as `mm_processor_kwargs`; vLLM checks
  that its image features fill exactly those placeholders;
- one request per prompt with `n = G` and the prompt's own seed (`prompt_seed`), so a step samples the same answers
  however prompts are sharded;
- each sampled token's log-prob under the temperature-scaled distribution (`logprobs_mode="processed_logprobs"`).

Weights: after every optimizer step `push_weights` hands vLLM the trainable parameters only (the frozen ones were
loaded from the checkpoint vLLM started from); under LoRA, the adapters are merged into their base weights, those
base weights are pushed, and the adapters unmerged. Between phases the engine sleeps (level 1: weights offloaded to
CPU memory, KV cache freed) so training gets the GPU memory back.

Log-prob consistency: vLLM's kernels are not the training forward's, so its log-probs are not used as the old
log-probs. The trajectories stage recomputes them with the training forward and logs the gap
(`rollout/engine_logprob_gap_max`, `..._mean`), the check DESIGN.md asks for.

vLLM is not a dependency: `pip install 'vlmrl[vllm]'` on a CUDA machine. Its CPU build runs Qwen2-VL only where a
CPU torchvision is installed (docs/scaling.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

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


def _image_budget(policy: Policy) -> dict[str, int]:
    """The processor's pixel budget, so vLLM resizes images exactly as training does (Qwen-style processors)."""
    proc = getattr(policy.processor, "image_processor", None)
    keys = ("min_pixels", "max_pixels")
    return {k: int(getattr(proc, k)) for k in keys if getattr(proc, k, None) is not None}


class VLLMEngine:
    """A colocated vLLM engine for one training process; see the module docstring."""

    def __init__(self, model_dir: str | Path, options: dict[str, Any] | None = None, seed: int = 0):
        try:
            from vllm import LLM
        except ImportError as error:  # the message says what to do
            raise ImportError("rollout.engine=vllm needs vLLM: pip install 'vlmrl[vllm]' (a CUDA machine), or use "
                              "rollout.engine=hf") from error
        unknown = set(options or {}) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"rollout.vllm: unknown options {sorted(unknown)}; allowed: {sorted(DEFAULTS)}")
        self.options = {**DEFAULTS, **(options or {})}
        o = self.options
        self.llm = LLM(model=str(model_dir), dtype=o["dtype"], gpu_memory_utilization=o["gpu_memory_utilization"],
                       max_model_len=o["max_model_len"], enforce_eager=o["enforce_eager"],
                       enable_sleep_mode=o["sleep"], distributed_executor_backend="external_launcher", seed=seed,
                       logprobs_mode="processed_logprobs")
        self.asleep = False
        if o["sleep"]:
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
    def push_weights(self, policy: Policy) -> int:
        """Load the policy's trainable weights (LoRA: the merged base weights of adapted modules) into vLLM; returns
        how many tensors were pushed. Call with full parameters (under FSDP2 inside `gathered(forward)`)."""
        self.wake()
        model = policy.model
        if policy.has_adapters:
            model.merge_adapter()
            try:
                adapted = {name.rsplit(".base_layer", 1)[0] for name, _ in model.named_modules()
                           if name.endswith(".base_layer")}
                weights = [(_hf_name(name), p.detach()) for name, p in model.named_parameters()
                           if "lora_" not in name and any(name.startswith(a + ".") for a in adapted)]
                self._load(weights)
            finally:
                model.unmerge_adapter()
        else:
            weights = [(name, p.detach()) for name, p in model.named_parameters() if p.requires_grad]
            self._load(weights)
        self.llm.reset_prefix_cache()
        return len(weights)

    def _load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.llm.apply_model(lambda model: model.load_weights(weights))

    # -- generation ---------------------------------------------------------------------------------------------------
    def generate(self, policy: Policy, prompts: PromptBatch, samples: list[dict], group_size: int,
                 max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                 prompt_seeds: list[int]) -> Rollout:
        """G answers per prompt; the same `Rollout` as the built-in sampler (engine="vllm")."""
        from vllm import SamplingParams

        self.wake()
        budget = _image_budget(policy)
        requests = []
        for p, sample in enumerate(samples):
            ids = prompts.input_ids[p][prompts.attention_mask[p].bool()].tolist()
            request: dict[str, Any] = {"prompt_token_ids": ids}
            if sample.get("images"):
                images = sample["images"]
                request["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
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


def _hf_name(name: str) -> str:
    """A PEFT parameter name as the base model names it (`base_model.model.x.base_layer.weight` -> `x.weight`)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


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
    return Rollout(index, ids, mask, logps, truncated, texts, engine="vllm")
