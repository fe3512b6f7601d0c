"""The `reward_model` reward: a learned outcome or process reward model's score of each answer (`vlmrl rm train`
makes one).

    rewards:
      - {name: reward_model, path: runs/rm}          # a run of `vlmrl rm train`, or its checkpoint-N folder
      - {name: reward_model, path: http://rm-host:8000/v1}   # or that RM served by `vlmrl serve runs/rm`
      - {name: reward_model, path: /models/Skywork-Reward-V2-Qwen3-0.6B}   # or a hub sequence-classifier RM,
      - {name: reward_model, path: http://rm-host:8000/v1, kwargs: {server: vllm}}   # also served by vLLM

The RM is loaded once per process and scores a batch in chunks of `batch_size` answers in the trainer's process, on
the trainer's device (`vlmrl train` binds it, `bind_reward_models`; elsewhere the current CUDA device when one is set
up, else the CPU), or on the server that serves it (vlmrl.rewards.served_rm: its own device or machine, shared by
every trainer process). Each prompt is rendered with the template the RM was trained with, its images included.
A Hugging Face `*ForSequenceClassification` RM (one output) scores the conversation through its own chat template,
in process or served by vLLM (vlmrl.rewards.hub_rm: text only, its own tokenizer).

Refusals, said once and plainly:
- `vlmrl train` refuses, before any training step, an RM whose tokenizer's vocabulary is not the policy's: it would
  score the policy's answers split into pieces it never learned from (`same_tokenizer: false` scores them anyway);
- an answer longer than the RM's `max_answer_tokens`, or a prompt longer than its `max_prompt_length` (both in its
  reward_model.json), is a `RewardFailure` naming the lengths: the sample is counted in reward/reward_model/failures
  and trains nothing (advantage 0), never scored on a cut text.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmrl.errors import ConfigError
from vlmrl.models.preflight import resolve_model
from vlmrl.rewards import hub_prm, hub_rm
from vlmrl.rewards.columns import per_sample
from vlmrl.rewards.reasoning import NO_STEPS
from vlmrl.rewards.registry import RewardBatch, RewardFailure, RewardSpec, register_reward
from vlmrl.rewards.served_rm import is_served, served_reward_model
from vlmrl.rewards.verifiable import ANSWER_TYPES

if TYPE_CHECKING:
    from vlmrl.models.reward_model import RewardModel

# torch and the model code load on first use: importing the rewards (every command does) stays light

NAME = "reward_model"
# what the reason of an answer or prompt too long names
TOO_LONG = ("max_answer_tokens", "max_prompt_length", hub_rm.TOO_LONG)
SERVERS = ("vlmrl", "vllm")  # what serves an RM at a URL: `vlmrl serve RM`, or vLLM (a hub sequence classifier)
_MODELS: dict[tuple[str, str, str], RewardModel] = {}
_VLLM_CLIENTS: dict[tuple[str, str | None, type], hub_rm.VllmRewardModel] = {}
_LOCK = threading.Lock()


def default_device() -> str:
    """The trainer's device where none is bound: the current CUDA device once CUDA is set up, else the CPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def get_reward_model(path: str | Path, device: str | None = None, dtype: str = "float32") -> RewardModel:
    """The process-wide RM at `path` (a model folder, or a run directory: its newest complete checkpoint), loaded
    once per (folder, device, dtype), in eval mode, its weights frozen."""
    from vlmrl.models.reward_model import RewardModel

    folder = str(Path(resolve_model(path, f"reward {NAME} path")).resolve())
    key = (folder, device or default_device(), dtype)
    with _LOCK:
        if key not in _MODELS:
            rm = RewardModel.from_pretrained(folder, dtype, key[1])
            rm.train(False)
            for p in [*rm.policy.model.parameters(), *rm.head.parameters()]:
                p.requires_grad_(False)
            _MODELS[key] = rm
        return _MODELS[key]


def check_vocabulary(mine: dict, tokenizer, where: str) -> None:
    """ConfigError when an RM's tokenizer (`mine`: its reward_model.json fingerprint) is not `tokenizer`'s."""
    from vlmrl.models.reward_model import vocabulary_fingerprint

    theirs = vocabulary_fingerprint(tokenizer)
    if mine != theirs:
        raise ConfigError(
            f"{where}: the reward model's tokenizer is not the policy's (vocabulary of {mine['size']} tokens, "
            f"sha256 {mine['sha256'][:12]}, against the policy's {theirs['size']}, {theirs['sha256'][:12]}): it would "
            "score the policy's answers split into tokens it never learned from. Train the RM from the policy's "
            "checkpoint (vlmrl rm train model.name_or_path=RUN/checkpoint-0), or set same_tokenizer: false in the "
            "reward's kwargs to score the text with the RM's own tokenizer anyway")


def bind_reward_models(specs: list[RewardSpec], policy) -> None:
    """For each `reward_model` component: load the RM on the policy's device (set as its `device` unless the recipe
    gives one) and refuse it, with a ConfigError, when its tokenizer is not the policy's (unless same_tokenizer is
    false). `vlmrl train` calls this once the policy is loaded, before any training step."""
    for i, spec in enumerate(specs):
        if spec.name != NAME:
            continue
        if "path" not in spec.kwargs:
            raise ConfigError(f"rewards[{i}] ({spec.key}): reward_model needs kwargs.path, the folder of an RM "
                              "trained by `vlmrl rm train` (or its run directory)")
        spec.kwargs.setdefault("device", str(policy.family.device))
        kw = spec.kwargs
        for path in member_paths(kw["path"]):
            if kw.get("server", "vlmrl") == "vllm" or hub_rm.is_hub_folder(path):  # reads text, its own tokenizer
                member(path, kw)  # loaded (or asked for its models) now: its errors before any step
                continue
            if is_served(path):  # asks the server's /info: its kind and tokenizer
                info = served_reward_model(path, kw.get("model"), kw.get("api_key_env"), kw.get("timeout", 120.0),
                                           kw.get("concurrency", 4)).info
            else:
                info = get_reward_model(path, kw["device"], kw.get("dtype", "float32")).info
            if kw.get("same_tokenizer", True):
                check_vocabulary(info["vocabulary"], policy.processor.tokenizer,
                                 f"rewards[{i}] ({spec.key}) {path}")


ENSEMBLES = ("mean", "min")


def member_paths(path: str | list[str]) -> list[str]:
    """The RM folders (or served RMs' URLs) of a `path` kwarg: one, or a list (an ensemble)."""
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    if not paths or not all(isinstance(p, (str, Path)) for p in paths):
        raise ConfigError(f"reward_model: path must be an RM folder or a list of them (an ensemble), got {path!r}")
    return [str(p) for p in paths]


def member(path: str, kw: dict):
    """The hub RM (a folder) or vLLM client (`server: vllm`) at `path`, made once per process."""
    if kw.get("server", "vlmrl") not in SERVERS:
        raise ConfigError(f"reward_model: server={kw['server']!r}; expected one of {SERVERS}")
    if kw.get("process") is not None and kw.get("server", "vlmrl") != "vllm":
        raise ConfigError(f"reward_model {path}: process settings are for a process RM served by vLLM (server: vllm); "
                          "an RM `vlmrl rm train` made carries its own in reward_model.json")
    if kw.get("server", "vlmrl") == "vllm":
        if not is_served(path):
            raise ConfigError(f"reward_model: server: vllm needs the server's URL as the path, got {path!r}")
        kind = hub_prm.VllmProcessRewardModel if kw.get("process") is not None else hub_rm.VllmRewardModel
        key = (path.rstrip("/"), kw.get("model"), kind)
        with _LOCK:  # one client per server, model and kind in the process (made once: it asks /v1/models)
            if key not in _VLLM_CLIENTS:
                _VLLM_CLIENTS[key] = kind(path, kw.get("model"), kw.get("api_key_env"), kw.get("timeout", 120.0),
                                          kw.get("concurrency", 4))
            return _VLLM_CLIENTS[key]
    return hub_rm.get_hub_reward_model(path, kw.get("device") or default_device(), kw.get("dtype", "float32"))


def member_values(path: str, kw: dict, completions: list[str], samples: list[dict], truncated: list[bool],
                  batch_size: int, request_size: int | None) -> list[Any]:
    """One member's score (or RewardFailure) of each answer, whatever kind of RM it is."""
    if kw.get("server", "vlmrl") == "vllm":
        extra = {} if kw.get("process") is None else {"process": kw["process"]}  # a process RM's step settings
        return member(path, kw).scores(completions, samples, truncated, kw.get("template", "{problem}"),
                                       kw.get("system"), **extra)
    if is_served(path):
        return served_reward_model(path, kw.get("model"), kw.get("api_key_env"), kw.get("timeout", 120.0),
                                   kw.get("concurrency", 4)).scores(completions, samples, truncated, request_size)
    if hub_rm.is_hub_folder(path):
        return member(path, kw).scores(completions, samples, truncated, batch_size, kw.get("template", "{problem}"),
                                       kw.get("system"), kw.get("max_length"))
    rm = get_reward_model(path, kw.get("device"), kw.get("dtype", "float32"))
    return member_scores(rm, path, completions, samples, truncated, batch_size)


@register_reward(NAME, inline=True, grades=ANSWER_TYPES)
def reward_model_reward(completions: list[str], *, path: str | list[str], batch_size: int = 16,
                        device: str | None = None, dtype: str = "float32", same_tokenizer: bool = True,
                        ensemble: str = "mean", disagreement_coef: float = 0.0, model: str | None = None,
                        api_key_env: str | None = None, timeout: float = 120.0, concurrency: int = 4,
                        request_size: int | None = None, server: str = "vlmrl", template: str = "{problem}",
                        system: str | None = None, max_length: int | None = None, process: dict | None = None,
                        images: list[Any] | None = None, completion_truncated: list[bool] | None = None,
                        **columns: Any) -> list[Any]:
    """The RM's score of each answer, from the RM at `path`: an outcome RM's scalar (unbounded; Bradley-Terry gives
    it meaning only as a difference between answers to one prompt, which is what group advantages use), or a process
    RM's step probabilities aggregated as its reward_model.json says (in [0, 1]; an answer without reasoning steps
    is a RewardFailure, counted in reward/reward_model/no_steps).

    `path` the URL of an RM served by `vlmrl serve RM_FOLDER` (http://HOST:PORT/v1): the RM runs there, on its own
    device or machine (in model calls of its --max-batch answers), and each batch goes to it in `concurrency`
    requests at once (of at most `request_size` answers when given; vlmrl.rewards.served_rm; `model`,
    `api_key_env`, `timeout` as for the judge).

    `path` a list: an ensemble of RMs (e.g. trained on other seeds or pairs), combined per answer as `ensemble`
    says, "mean" minus `disagreement_coef` x their standard deviation (uncertainty-weighted optimisation, Coste et
    al. 2024: an answer the members disagree on is one a policy may be exploiting) or "min" (worst case); logged:
    reward/reward_model/disagreement (the mean standard deviation). An answer any member cannot score fails.

    A finished answer is scored with its end-of-turn token after it, as the RM was trained; a truncated one without.
    An answer past the RM's `max_answer_tokens` or a prompt past its `max_prompt_length` is a RewardFailure naming
    both numbers (counted, trains nothing). `same_tokenizer` is checked by `vlmrl train` (`bind_reward_models`).
    Logged per step: reward/reward_model/too_long (answers or prompts refused for their length).

    `path` a Hugging Face `*ForSequenceClassification` folder with one output, or (`server: "vllm"`) the URL of
    vLLM serving one: the conversation [`system`?, user: `template` filled with the sample's columns, assistant: the
    answer] through the RM's own chat template, scored as its model card scores it (its raw output); text only, so
    images are not seen (counted: images_unseen) and the policy's tokenizer is not checked; an answer or prompt
    holding the RM's special tokens as text is not scored (counted: special_tokens); `max_length` caps the
    conversation's tokens below the model's own limit (vlmrl.rewards.hub_rm). With `process` (a dict, {} for its
    defaults) the vLLM-served RM is a process RM such as Qwen2.5-Math-PRM: the steps joined by its step token, one
    probability per step, aggregated (vlmrl.rewards.hub_prm)."""
    if ensemble not in ENSEMBLES:
        raise ConfigError(f"reward_model: ensemble={ensemble!r}; expected one of {ENSEMBLES}")
    n = len(completions)
    truncated = per_sample(completion_truncated, n, False)
    image_lists = per_sample(images, n, None)
    samples = [{**{k: v[i] for k, v in columns.items() if isinstance(v, list) and len(v) == n},
                "images": image_lists[i] or []} for i in range(n)]
    kw = {"device": device, "dtype": dtype, "model": model, "api_key_env": api_key_env, "timeout": timeout,
          "concurrency": concurrency, "server": server, "template": template, "system": system,
          "max_length": max_length, "process": process}
    paths = member_paths(path)
    members = [member_values(p, kw, completions, samples, truncated, batch_size, request_size) for p in paths]
    values: list[Any] = []
    spreads = []
    for scores in zip(*members, strict=True):
        failed = [v for v in scores if isinstance(v, RewardFailure)]
        if failed:
            values.append(failed[0])
            continue
        mean = sum(scores) / len(scores)
        spread = (sum((v - mean) ** 2 for v in scores) / len(scores)) ** 0.5
        spreads.append(spread)
        values.append(min(scores) if ensemble == "min" else mean - disagreement_coef * spread)
    # (a served RM's reasons carry its URL first; a request that failed is neither of these, only a failure)
    too_long = sum(isinstance(v, RewardFailure) and any(k in v.reason for k in TOO_LONG) for v in values)
    no_steps = sum(isinstance(v, RewardFailure) and v.reason.endswith(NO_STEPS) for v in values)
    extra = {"too_long": float(too_long), "no_steps": float(no_steps)}
    if server == "vllm" or any(hub_rm.is_hub_folder(p) for p in paths):  # text-only RMs: what they did not read
        extra["images_unseen"] = float(hub_rm.unseen_images(samples))
        extra["special_tokens"] = float(sum(isinstance(v, RewardFailure) and hub_rm.SPECIAL in v.reason
                                            for v in values))
    if len(members) > 1 and spreads:
        extra["disagreement"] = sum(spreads) / len(spreads)
    return RewardBatch(values, extra)


def text_step_logits(rm: RewardModel, prompts, rows, texts: list[str], finished: list[bool] | None = None):
    """A process RM's step logits of each answer text (a tensor of one per step): its steps split as its
    reward_model.json says (`step_spans`), each read after the step's last token (with its log-prob term, over the
    step's tokens)."""
    from vlmrl.models.reward_model import answer_ids, step_token_spans
    from vlmrl.rewards.reasoning import step_spans

    cfg = rm.info["process"]
    ids, mask = answer_ids(rm.policy, texts, finished)
    spans = [step_spans(t, cfg["split"], cfg["think_tag"]) for t in texts]
    return rm.step_logits(prompts, rows, ids, mask, step_token_spans(rm.policy, texts, spans))


def answer_scores(rm: RewardModel, prompts, rows, texts: list[str], finished: list[bool]
                  ) -> tuple[list[float | None], list[list[float]] | None]:
    """(each answer's score, a process RM's step probabilities per answer or None for an outcome RM): an outcome
    RM's scalar, or a process RM's step probabilities (sigmoid of its step logits) aggregated as its
    reward_model.json says (None for an answer without reasoning steps)."""
    import torch

    from vlmrl.models.reward_model import aggregate_steps, answer_ids

    if rm.kind == "outcome":
        return rm.score(prompts, rows, *answer_ids(rm.policy, texts, finished)).tolist(), None
    steps = [torch.sigmoid(x).tolist() for x in text_step_logits(rm, prompts, rows, texts, finished)]
    return [aggregate_steps(p, rm.info["process"]["aggregate"]) for p in steps], steps


def member_scores(rm: RewardModel, path: str, completions: list[str], samples: list[dict], truncated: list[bool],
                  batch_size: int, steps: list | None = None) -> list[Any]:
    """One RM's score (or RewardFailure) of each answer, in chunks of `batch_size`; with `steps` (a list of None,
    one per answer), a process RM's step probabilities of each scored answer are put in it too."""
    import torch

    from vlmrl.models.reward_model import answer_ids

    n = len(completions)
    limit = rm.info["max_answer_tokens"]
    where = f"this reward model scores at most {limit} (max_answer_tokens in {path}/reward_model.json)"
    values: list[Any] = [None] * n
    chars = rm.policy.processor.max_prompt_chars(limit)  # longer texts are refused before they are tokenised
    for i, c in enumerate(completions):
        if len(str(c)) > chars:
            values[i] = RewardFailure(f"answer of {len(str(c))} characters, more than {limit} tokens hold; {where}")
    fits = [i for i in range(n) if values[i] is None]
    lengths = answer_ids(rm.policy, [str(completions[i]) for i in fits],
                         [not truncated[i] for i in fits])[1].sum(-1).tolist() if fits else []
    for i, length in zip(fits, lengths, strict=True):
        if length > limit:
            values[i] = RewardFailure(f"answer of {length} tokens; {where}")
    todo = [i for i in range(n) if values[i] is None]
    for start in range(0, len(todo), batch_size):
        rows = todo[start:start + batch_size]
        # a prompt once for all of its answers in the chunk: its images go through the vision tower once
        unique: dict[tuple, int] = {}  # prompt key -> its index among the chunk's distinct prompts
        of, firsts = [], []  # each answer's distinct prompt; each distinct prompt's first answer
        for i in rows:
            key = _prompt_key(samples[i])
            if key not in unique:
                unique[key] = len(firsts)
                firsts.append(i)
            of.append(unique[key])
        scorable, prompts = _prompts(rm, [samples[i] for i in firsts])
        place = {u: k for k, u in enumerate(u for u, reason in enumerate(scorable) if reason is None)}
        for j, u in enumerate(of):
            if scorable[u] is not None:
                values[rows[j]] = RewardFailure(scorable[u])
        keep = [j for j, u in enumerate(of) if scorable[u] is None]
        if not keep:
            continue
        texts = [str(completions[rows[j]]) for j in keep]
        with torch.no_grad():
            scores, probs = answer_scores(rm, prompts, torch.tensor([place[of[j]] for j in keep]), texts,
                                          [not truncated[rows[j]] for j in keep])
        for k, (j, value) in enumerate(zip(keep, scores, strict=True)):
            values[rows[j]] = RewardFailure(NO_STEPS) if value is None else value
            if steps is not None and probs is not None and value is not None:
                steps[rows[j]] = probs[k]
    return values


def _prompt_key(sample: dict) -> tuple:
    """What makes two answers' prompts one: the sample's text columns and its image objects."""
    return (tuple(sorted((k, v) for k, v in sample.items() if isinstance(v, str))),
            tuple(id(im) for im in sample.get("images") or []))


def _prompts(rm: RewardModel, samples: list[dict]):
    """(per sample: None or why its prompt cannot be scored, the scorable samples' PromptBatch)."""
    from vlmrl.models.batch import PromptTooLongError

    try:
        return [None] * len(samples), rm.prompts(samples)
    except PromptTooLongError:
        pass
    reasons: list[str | None] = []
    for s in samples:  # find which: each prompt alone
        try:
            rm.prompts([s])
            reasons.append(None)
        except PromptTooLongError as e:
            reasons.append(f"prompt longer than this reward model's max_prompt_length "
                           f"({rm.info['max_prompt_length']} tokens): {e}")
    ok = [s for s, r in zip(samples, reasons, strict=True) if r is None]
    return reasons, rm.prompts(ok) if ok else None
