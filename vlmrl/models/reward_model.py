"""Reward models: a VLM with a scalar head. An outcome RM reads the final hidden state of the last real token of
prompt + answer; a process RM (PRM) reads the hidden state after each reasoning step's last token, the probability
that the step is right, and aggregates an answer's steps (min, product, last or mean). `vlmrl rm train` fits an
outcome RM on preference pairs and a PRM on step-labelled answers (vlmrl.trainer.rm); the `reward_model` reward
scores answers with either (vlmrl.rewards.reward_model).

On disk an RM is a model folder (what `Policy.save_pretrained` writes: the VLM with its LM head, and its processor;
it loads with `from_pretrained` like any checkpoint) plus two files:

- `reward_model.json` (REWARD_MODEL_FILE) marks the folder as a reward model and says how to score with it: the
  head's file and width, the prompt template it was trained with, the longest prompt and answer it scores, and a
  fingerprint of its tokenizer's vocabulary (what the reward checks against the policy's); a PRM's also how it
  splits steps and aggregates them (`process`: {split, think_tag, aggregate});
- `reward_head.safetensors` (the head's weight [1, H] and bias [1]).

`RewardModel.from_pretrained(folder)` loads both back.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from vlmrl.errors import PathError
from vlmrl.models.batch import PromptBatch, PromptEmbeds
from vlmrl.models.forward import head_chunk_tokens, token_scores
from vlmrl.models.policy import Policy, load_policy

REWARD_MODEL_FILE = "reward_model.json"
HEAD_FILE = "reward_head.safetensors"
FORMAT_VERSION = 1


def vocabulary_fingerprint(tokenizer) -> dict:
    """{"size", "sha256"} of a tokenizer's whole vocabulary (token -> id, added tokens included): two tokenizers with
    the same fingerprint split every text into the same ids."""
    vocab = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
    return {"size": len(vocab), "sha256": digest}


def answer_ids(policy: Policy, texts: list[str], finished: list[bool] | None = None) -> tuple[Tensor, Tensor]:
    """Answers tokenised as the policy wrote them, right-padded: (ids [N, T], mask [N, T]). A finished answer gets
    the end-of-turn token after it (as generation and SFT targets end); an unfinished one (cut at the token budget)
    does not, so the RM sees that it stopped short. Text never becomes a special token."""
    tok = policy.processor.literal_tokenizer  # special tokens split, without touching the shared tokenizer
    finished = [True] * len(texts) if finished is None else finished
    seqs = [tok(t, add_special_tokens=False)["input_ids"] + ([policy.eos_token_ids[0]]
            if done else []) for t, done in zip(texts, finished, strict=True)]
    width = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), policy.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids, mask


def answer_hidden(family, prompt: PromptEmbeds, ids: Tensor, mask: Tensor) -> Tensor:
    """Final hidden states [N, T + 1, H] over each row's answer: column 0 is the prompt's last token, column k + 1
    answer token k; prompt row n (left-padded) followed by answer n (right-padded), one decoder pass over both,
    positions continuing the prompt's (M-RoPE or 1-D) as in generation."""
    t = ids.shape[1]
    device = prompt.embeds.device
    ids, mask = ids.to(device), mask.to(device)
    embeds = torch.cat([prompt.embeds, family.embed_tokens(ids)], dim=1)
    attention = torch.cat([prompt.attention_mask, mask.to(prompt.attention_mask.dtype)], dim=1)
    positions = torch.cat([prompt.position_ids, prompt.completion_positions(0, t)], dim=2)
    hidden = family.forward_hidden(embeds, attention, positions, extras=prompt.extras)
    return hidden[:, prompt.embeds.shape[1] - 1:]


def step_token_spans(policy: Policy, texts: list[str], spans: list[list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
    """For each answer, each step's (first, last) token index into its `answer_ids` tokens: the first token holding
    a character of the step and the one holding its last character (where a process reward model reads that step's
    score, having seen the step and everything before it)."""
    tok = policy.processor.literal_tokenizer
    out = []
    for text, steps in zip(texts, spans, strict=True):
        offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        out.append([(next(k for k, (a, b) in enumerate(offsets) if b > start and b > a),
                     next(k for k, (a, b) in enumerate(offsets) if b >= end and b > a)) for start, end in steps])
    return out


def step_token_ends(policy: Policy, texts: list[str], spans: list[list[tuple[int, int]]]) -> list[list[int]]:
    """For each answer, the index of the token holding each step's last character (`step_token_spans`)."""
    return [[last for _, last in row] for row in step_token_spans(policy, texts, spans)]


def answer_logprobs(family, hidden: Tensor, ids: Tensor, mask: Tensor) -> Tensor:
    """[N, T] log-probabilities (temperature 1, 0 on padding) of answer tokens `ids` under the model's own
    language-model head, from `answer_hidden`'s [N, T + 1, H] (column k predicts answer token k): the training
    forward's `token_scores`, its logits in chunks."""
    device = hidden.device
    return token_scores(family.lm_head, hidden[:, :-1], ids.to(device), mask.to(device),
                        chunk_tokens=head_chunk_tokens(family))[0]


AGGREGATES = ("min", "product", "last", "mean")


def aggregate_steps(probabilities: list[float], how: str = "min") -> float | None:
    """One answer's score from its steps' probabilities of being right: the weakest step ("min", as Lightman et al.
    and Math-Shepherd select), all steps right ("product"), the last step ("last") or "mean". None without steps."""
    if not probabilities:
        return None
    if how == "min":
        return min(probabilities)
    if how == "product":
        return math.prod(probabilities)
    if how == "last":
        return probabilities[-1]
    if how == "mean":
        return sum(probabilities) / len(probabilities)
    raise ValueError(f"aggregate={how!r}: expected one of {AGGREGATES}")


@dataclass
class RewardModel:
    """A policy's VLM (and processor) with a scalar head: r = head(h_last), h_last the final hidden state of the last
    real token of prompt + answer. With a log-prob term (`logprob_weight`, a learned scalar a) the score also counts
    how likely the VLM's own language model finds what it scores: r = head(h) + a * sum log p(scored tokens), the
    answer's tokens for an outcome RM, the step's for a PRM (a step the model would not have written is suspect: the
    implicit process reward of Yuan et al. 2024, here one feature the RM learns to weigh). `info` is the folder's
    reward_model.json (without the head's weights)."""

    policy: Policy
    head: nn.Linear
    info: dict = field(default_factory=dict)
    logprob_weight: nn.Parameter | None = None

    @classmethod
    def on(cls, policy: Policy, prompt_template: str = "{problem}", max_prompt_length: int = 512,
           max_answer_tokens: int = 512, process: dict | None = None, logprob_term: bool = False) -> RewardModel:
        """A new RM on `policy`'s weights: the head starts at zero (every answer scores 0 until trained; with
        `logprob_term`, its log-prob, the term's weight starting at 1). With `process` ({split, think_tag,
        aggregate}) a process reward model: the head scores every reasoning step."""
        hidden = policy.model.config.text_config.hidden_size
        head = nn.Linear(hidden, 1).to(policy.family.device)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        kind = {"kind": "process", "pooling": "step_ends", "process": dict(process)} if process else {
            "kind": "outcome", "pooling": "last_token"}
        info = {"vlmrl_reward_model": FORMAT_VERSION, **kind,
                "head": {"file": HEAD_FILE, "in_features": hidden, "out_features": 1, "logprob_term": logprob_term},
                "prompt_template": prompt_template, "max_prompt_length": max_prompt_length,
                "max_answer_tokens": max_answer_tokens,
                "vocabulary": vocabulary_fingerprint(policy.processor.tokenizer)}
        weight = nn.Parameter(torch.ones(1, device=policy.family.device)) if logprob_term else None
        return cls(policy, head, info, weight)

    @property
    def kind(self) -> str:
        """"outcome" (one score per answer) or "process" (one per reasoning step, aggregated per answer)."""
        return self.info.get("kind", "outcome")

    def parameters(self) -> list[nn.Parameter]:
        """What training updates: the VLM's trainable weights, the head and the log-prob term's weight."""
        return [p for p in self.policy.model.parameters() if p.requires_grad] + list(self.head.parameters()) + (
            [self.logprob_weight] if self.logprob_weight is not None else [])

    def train(self, mode: bool = True) -> RewardModel:
        self.policy.model.train(mode)
        self.head.train(mode)
        return self

    def prompts(self, samples: list[dict]) -> PromptBatch:
        """Samples' prompts through the RM's processor and template (PromptTooLongError past max_prompt_length)."""
        problems = [self.info["prompt_template"].format(**s) for s in samples]
        return self.policy.processor(problems, [list(s.get("images") or []) for s in samples],
                                     [str(s.get("id", i)) for i, s in enumerate(samples)],
                                     self.info["max_prompt_length"])

    def score(self, prompts: PromptBatch, rows: Tensor, ids: Tensor, mask: Tensor) -> Tensor:
        """Scores [N] (float32) of answers `ids`/`mask` [N, T], answer n answering prompt `rows[n]` of `prompts`:
        each prompt's images go through the vision tower once for all of its answers."""
        family = self.policy.family
        embeds = family.prompt_embeds(prompts).select(rows.to(family.device))
        hidden = answer_hidden(family, embeds, ids, mask)
        last = hidden[torch.arange(len(ids), device=hidden.device), mask.to(hidden.device).sum(-1)]
        scores = self.head(last.float()).squeeze(-1)
        if self.logprob_weight is None:
            return scores
        return scores + self.logprob_weight * answer_logprobs(family, hidden, ids, mask).sum(-1)

    def step_logits(self, prompts: PromptBatch, rows: Tensor, ids: Tensor, mask: Tensor,
                    steps: list[list[tuple[int, int]]]) -> list[Tensor]:
        """A process RM's logit of each step being right, per answer ([steps of answer n]): the head on the hidden
        state of each step's last token (`step_token_spans`: each step's (first, last) token), having seen the
        prompt and the answer up to there; with the log-prob term, plus its weight times the step's tokens'
        log-probability."""
        family = self.policy.family
        embeds = family.prompt_embeds(prompts).select(rows.to(family.device))
        hidden = answer_hidden(family, embeds, ids, mask)
        logits = self.head(hidden.float()).squeeze(-1)
        out = [logits[n, torch.tensor([b for _, b in e], dtype=torch.long, device=logits.device) + 1]
               for n, e in enumerate(steps)]
        if self.logprob_weight is None:
            return out
        logp = answer_logprobs(family, hidden, ids, mask)
        return [x + self.logprob_weight * torch.stack([logp[n, a:b + 1].sum() for a, b in steps[n]]) if steps[n]
                else x for n, x in enumerate(out)]  # (an answer without steps: none to score)

    def save_head(self, path: str | Path, extra: dict | None = None) -> None:
        """Write reward_model.json (with `extra` merged in, e.g. the held-out accuracy) and the head's weights."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.info = {**self.info, **(extra or {})}
        tensors = dict(self.head.state_dict())
        if self.logprob_weight is not None:
            tensors["logprob_weight"] = self.logprob_weight
        save_file({k: v.detach().float().cpu().contiguous() for k, v in tensors.items()}, path / HEAD_FILE)
        (path / REWARD_MODEL_FILE).write_text(json.dumps(self.info, indent=1) + "\n")

    def save_pretrained(self, path: str | Path, extra: dict | None = None) -> None:
        """The model folder (`Policy.save_pretrained`) and the head's two files."""
        self.policy.save_pretrained(path)
        self.save_head(path, extra)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str = "float32", device: str = "cpu",
                        autocast: bool = True) -> RewardModel:
        """Load an RM folder (`save_pretrained`); PathError when the folder is not one."""
        from safetensors.torch import load_file

        path = Path(path)
        marker = path / REWARD_MODEL_FILE
        if not marker.is_file():
            raise PathError(f"{path}: not a reward model (no {REWARD_MODEL_FILE}); train one with `vlmrl rm train`")
        info = json.loads(marker.read_text())
        if info.get("vlmrl_reward_model") != FORMAT_VERSION or info.get("kind") not in ("outcome", "process"):
            raise PathError(f"{marker}: format {info.get('vlmrl_reward_model')!r}, kind {info.get('kind')!r}; this "
                            f"vlmrl reads outcome and process reward models of format {FORMAT_VERSION}")
        policy = load_policy(path, dtype, device, autocast=autocast)
        tensors = load_file(path / info["head"]["file"])
        weight = tensors.pop("logprob_weight", None) if info["head"].get("logprob_term") else None
        head = nn.Linear(info["head"]["in_features"], 1)
        head.load_state_dict(tensors)
        device = policy.family.device
        return cls(policy, head.to(device), info, None if weight is None else nn.Parameter(weight.to(device)))
