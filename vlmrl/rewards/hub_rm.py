"""A reward model from the Hugging Face hub as a `reward_model` member: a sequence classifier with one output
(`*ForSequenceClassification`, num_labels 1, as Skywork-Reward and most published outcome RMs are), scored in the
trainer's process or served by vLLM.

    rewards:
      - {name: reward_model, path: /models/Skywork-Reward-V2-Qwen3-0.6B}       # a local folder: scored in process
      - {name: reward_model, path: http://rm-host:8000/v1, kwargs: {server: vllm}}
        # `vllm serve /models/Skywork-Reward-V2-Qwen3-0.6B --runner pooling`

Each answer is scored as the model card scores one: the conversation [system?, user, assistant] through the RM
tokenizer's own chat template, and the classifier's raw output (its logit, no sigmoid) at the conversation's last
token. The user turn is `template` (default "{problem}") filled with the sample's columns; the assistant turn is the
answer as the policy wrote it. A truncated answer is left open (the template's `continue_final_message`), so the RM
sees it stopped short; a template that rewrites the answer (Qwen3's moves think blocks) cannot leave it open, and such
an answer is a RewardFailure that says so.

These RMs read text with their own tokenizer, so the policy's tokenizer is not checked against theirs. They see no
images: an answer to a prompt with images is scored on its text, and counted (reward/reward_model/images_unseen).
An answer or prompt holding one of the RM tokenizer's special tokens as text (`<|im_end|>`) is not scored: the
template would read it as the end of the turn, and a policy could forge a turn the RM trusts. It is a RewardFailure
counted in reward/reward_model/special_tokens. Served by vLLM the client does not have the tokenizer, and refuses
the control-token spellings of the common chat templates (`<|...|>`, `<start_of_turn>`, `<end_of_turn>`, `[INST]`).

vLLM's `POST /classify` (chat form, `use_activation: false`) gets one request per answer, `concurrency` at a time,
with the judge's retries; its scores equal the in-process ones (tests/test_vllm_real.py checks it against the real
engine). A conversation longer than the served model's context is a RewardFailure counted in too_long.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from vlmrl.errors import ConfigError
from vlmrl.rewards.registry import FatalRewardError, RewardFailure

log = logging.getLogger(__name__)

ARCHITECTURE = "ForSequenceClassification"
TOO_LONG = "max_length"  # what a too-long conversation's reason names (reward_model.TOO_LONG counts it)
SPECIAL = "a special token of the reward model's tokenizer"  # what a refused special token's reason says
# the control tokens of ChatML/Qwen/Llama 3/Phi (<|...|>), Gemma and Mistral/Llama 2, for a served RM's texts
CONTROL_TOKENS = re.compile(r"<\|[^\s<>|]{1,40}\|>|<start_of_turn>|<end_of_turn>|\[/?INST\]")
_MODELS: dict[tuple[str, str, str], HubRewardModel] = {}
_LOCK = threading.Lock()
_WARNED: list[bool] = []  # the images warning, once per process


class TemplateColumnMissing(FatalRewardError):
    """The reward's template names a column the samples do not have: every answer would fail alike, so the run
    stops with what to set."""


@functools.lru_cache(maxsize=256)
def is_hub_folder(path: Any) -> bool:
    """Whether `path` is a model folder of a sequence classifier that vlmrl did not train (no reward_model.json);
    asked once per path (every reward call asks)."""
    folder = Path(str(path))
    if not (folder / "config.json").is_file() or (folder / "reward_model.json").exists():
        return False
    try:
        architectures = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (ValueError, AttributeError):
        return False
    return any(str(a).endswith(ARCHITECTURE) for a in architectures)


def conversations(completions: list[str], samples: list[dict], template: str, system: str | None,
                  special: re.Pattern, where: str) -> list[list[dict] | RewardFailure]:
    """Each answer's messages [system?, user, assistant], or a RewardFailure for text holding a special token.
    A template column a sample does not have stops the run (TemplateColumnMissing)."""
    out: list[list[dict] | RewardFailure] = []
    for i, (completion, sample) in enumerate(zip(completions, samples, strict=True)):
        try:
            user = template.format_map({k: v for k, v in sample.items() if isinstance(v, str)})
        except KeyError as exc:
            have = sorted(k for k, v in sample.items() if isinstance(v, str))
            raise TemplateColumnMissing(f"{where}: template {template!r} needs column {exc.args[0]!r}, which sample "
                                        f"{i} does not have (it has {have}); set the reward's kwargs.template") from None
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}, {"role": "assistant", "content": str(completion)}]
        found = _special(special, [m["content"] for m in messages])
        out.append(RewardFailure(f"the {'answer' if found[1] == len(messages) - 1 else 'prompt'} holds {found[0]!r}, "
                                 f"{SPECIAL}, as text: scored, it would end or forge a turn; not scored")
                   if found else messages)
    return out


def _special(special: re.Pattern, texts: list[str]) -> tuple[str, int] | None:
    """(the first special token found, the index of the text holding it), or None."""
    for k, text in enumerate(texts):
        hit = special.search(text)
        if hit:
            return hit.group(0), k
    return None


def special_tokens(tokens) -> re.Pattern:
    """A pattern that finds any of `tokens` in a text, the longest first; one that finds nothing for no tokens."""
    spelled = sorted({str(t) for t in tokens if t}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, spelled)) if spelled else r"(?!)")


def unseen_images(samples: list[dict]) -> int:
    """How many of the answers' prompts have images (which a text RM does not see); said once per process."""
    n = sum(bool(s.get("images")) for s in samples)
    if n and not _WARNED:
        _WARNED.append(True)
        log.warning("reward_model: a Hugging Face sequence-classifier RM reads text only; answers to prompts with "
                    "images are scored without them (counted in reward/reward_model/images_unseen)")
    return n


class HubRewardModel:
    """A `*ForSequenceClassification` folder with one output, loaded in this process (module docstring)."""

    kind = "outcome"

    def __init__(self, folder: str, device: str = "cpu", dtype: str = "float32"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.folder = folder
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"reward_model path {folder}: its tokenizer has no chat template, so an answer cannot "
                              "be put in a conversation as its model card scores it")
        self.model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=getattr(torch, dtype))
        labels = self.model.config.num_labels
        if labels != 1:
            raise ConfigError(f"reward_model path {folder}: a classifier with {labels} outputs, not a reward model "
                              "(num_labels 1): vlmrl cannot tell which output is the reward")
        self.model.to(device).train(False)
        for p in self.model.parameters():
            p.requires_grad_(False)
        config = self.model.config.get_text_config()
        self.max_length = min(int(getattr(config, "max_position_embeddings", None) or 2**31),
                              int(self.tokenizer.model_max_length or 2**31))
        self.special = special_tokens([*self.tokenizer.all_special_tokens,
                                       *(t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special)])
        # no token spells more characters than its vocabulary entry (vlmrl's processor bounds prompts the same
        # way): a longer conversation is refused before it is tokenised, which costs seconds for megabytes of text
        self.max_token_chars = max(1, max(map(len, self.tokenizer.get_vocab()), default=1))
        self.device = device
        self._lock = threading.Lock()  # the pad id is set on the shared config for each forward
        self.info = {"model": folder, "kind": self.kind, "vocabulary": None}

    def ids(self, messages: list[dict], truncated: bool) -> list[int]:
        """The conversation's token ids, as `apply_chat_template(..., tokenize=True)` makes them."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=truncated)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def scores(self, completions: list[str], samples: list[dict], truncated: list[bool], batch_size: int = 16,
               template: str = "{problem}", system: str | None = None, max_length: int | None = None) -> list[Any]:
        """Each answer's score (the classifier's logit), or a RewardFailure saying why it has none."""
        import torch

        limit = min(max_length or self.max_length, self.max_length)
        values: list[Any] = conversations(completions, samples, template, system, self.special,
                                          f"reward_model {self.folder}")
        ids: dict[int, list[int]] = {}
        for i, messages in enumerate(values):
            if isinstance(messages, RewardFailure):
                continue
            chars = sum(len(m["content"]) for m in messages)
            if chars > limit * self.max_token_chars:
                values[i] = RewardFailure(f"conversation of {chars} characters, more than this reward model's "
                                          f"{TOO_LONG} ({limit} tokens) can hold in {self.folder}")
                continue
            try:
                row = self.ids(messages, truncated[i])
            except ValueError as exc:  # continue_final_message on a template that rewrites the answer
                values[i] = RewardFailure(f"a truncated answer, and this reward model's chat template cannot leave "
                                          f"it open ({str(exc).splitlines()[0]}); not scored")
                continue
            if len(row) > limit:
                values[i] = RewardFailure(f"conversation of {len(row)} tokens, more than this reward model's "
                                          f"{TOO_LONG} ({limit}) in {self.folder}")
            else:
                ids[i] = row
        todo = sorted(ids, key=lambda i: len(ids[i]))  # similar lengths together: less padding
        config = self.model.config.get_text_config()
        for start in range(0, len(todo), batch_size):
            rows = todo[start:start + batch_size]
            width = max(len(ids[i]) for i in rows)
            pad = config.pad_token_id
            if pad is None:  # the model card's batch of one scores the last token: pad with an id no row holds
                used = {t for i in rows for t in ids[i]}
                pad = next(t for t in range(config.vocab_size - 1, -1, -1) if t not in used)
            batch = torch.full((len(rows), width), pad, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):  # right padding: the rightmost non-pad token is the row's last
                batch[r, :len(ids[i])] = torch.tensor(ids[i])
                mask[r, :len(ids[i])] = 1
            with self._lock, torch.no_grad():
                saved, config.pad_token_id = config.pad_token_id, pad
                try:
                    logits = self.model(input_ids=batch.to(self.device), attention_mask=mask.to(self.device)).logits
                finally:
                    config.pad_token_id = saved
            for i, value in zip(rows, logits[:, 0].float().tolist(), strict=True):
                values[i] = value
        return values


def get_hub_reward_model(path: str, device: str, dtype: str = "float32") -> HubRewardModel:
    """The process-wide hub RM at folder `path`, loaded once per (folder, device, dtype)."""
    folder = str(Path(path).resolve())
    key = (folder, device, dtype)
    with _LOCK:
        if key not in _MODELS:
            _MODELS[key] = HubRewardModel(folder, key[1], dtype)
        return _MODELS[key]


def classify_reply(raw: bytes, attempts: int) -> float | None:
    """The one raw output of a vLLM /classify reply (None for another body: retried as malformed)."""
    try:
        data = json.loads(raw)["data"]
        probs = data[0]["probs"]
        return float(probs[0]) if len(data) == 1 and len(probs) == 1 else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None


class VllmRewardModel:
    """The client of a sequence-classifier RM served by vLLM (`vllm serve FOLDER --runner pooling`): POST /classify
    per answer, chat form, raw output."""

    kind = "outcome"
    route = "/classify"  # vLLM's pooling routes sit beside /v1, not under it

    def parse(self, raw: bytes, attempts: int) -> Any:
        return classify_reply(raw, attempts)

    def __init__(self, base_url: str, model: str | None = None, api_key_env: str | None = None,
                 timeout: float = 120.0, concurrency: int = 4, max_retries: int = 3):
        from vlmrl.rewards.served_rm import Refusals, rm_endpoint

        root = base_url.rstrip("/").removesuffix("/v1")
        self.endpoint = rm_endpoint(root, self.route, self.parse, api_key_env, timeout, concurrency, max_retries)
        try:
            served = [m["id"] for m in self.endpoint.get_json("/v1/models", timeout=min(30.0, timeout))["data"]]
        except Exception as exc:  # noqa: BLE001 - any failure is reported the same way
            raise ConfigError(f"reward_model path {base_url} (server: vllm): GET /v1/models failed ({exc}); is a "
                              "sequence-classifier RM served there (`vllm serve FOLDER --runner pooling`)?") from None
        if model is not None and model not in served:
            raise ConfigError(f"reward_model path {base_url} serves {served}, not model={model!r}")
        self.model = model or served[0]
        self.info = {"model": self.model, "kind": self.kind, "vocabulary": None}
        self.refusals = Refusals(self.endpoint.url)
        self._pool = ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="vlmrl-vllm-rm")

    def scores(self, completions: list[str], samples: list[dict], truncated: list[bool],
               template: str = "{problem}", system: str | None = None) -> list[Any]:
        """Each answer's score (the classifier's raw output), or a RewardFailure saying why it has none."""
        values: list[Any] = conversations(completions, samples, template, system, CONTROL_TOKENS,
                                          f"reward_model {self.endpoint.url}")
        todo = [i for i, v in enumerate(values) if not isinstance(v, RewardFailure)]
        bodies = [{"model": self.model, "messages": values[i], "use_activation": False,
                   "continue_final_message": bool(truncated[i])} for i in todo]
        for i, value in zip(todo, self._pool.map(self._post, bodies), strict=True):
            values[i] = value
        return values

    def _post(self, body: dict) -> Any:
        from vlmrl.rewards.judge_http import JudgeError, JudgeRefused

        try:
            value = self.endpoint.post(body)
        except JudgeRefused as exc:
            if "maximum context length" in exc.message:  # this answer's own length: not a refusal that repeats
                return RewardFailure(f"reward model {self.endpoint.url}: longer than its {TOO_LONG}: {exc.message}")
            if "continue_final_message" in exc.message:
                return RewardFailure(f"a truncated answer, and the served reward model's chat template cannot "
                                     f"leave it open: {exc.message}")
            self.refusals.refused(exc)  # the same refusal again and again stops the run
            return RewardFailure(str(exc))
        except JudgeError as exc:  # retries spent
            return RewardFailure(str(exc))
        self.refusals.replied()
        return value
