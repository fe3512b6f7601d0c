"""One ReCLIP step in four stages: collect (retrieve K candidates) -> score (the GRM) -> advantages -> update.

For a batch of items, each direction (t2i: a caption retrieves images; i2t: an image retrieves captions) has a
candidate pool: the batch's items (embedded with gradients), optionally the batch's hard-negative captions (i2t) and a
memory bank of earlier-embedded training items (no gradient; their own batch copies masked out). The policy is
pi(c | q) = softmax(sim(q, c) / tau). Both towers receive gradients: the query side in both directions, the candidate
side through the batch part of the pool.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from vlmrl.cache import BoundedLRU
from vlmrl.reclip.config import JudgeConfig, RLConfig
from vlmrl.reclip.feedback import compress, feedback_reward
from vlmrl.reclip.judge import Judge, View
from vlmrl.reclip.losses import (
    distill_kl,
    group_advantages,
    info_nce,
    pick_candidates,
    policy_weighted_advantages,
    reinforce_loss,
    retrieval_logprobs,
)
from vlmrl.reclip.scenes import CaptionItem, Description
from vlmrl.reclip.store import InputStore
from vlmrl.reclip.students import TwoTower


@dataclass
class TextRef:
    """A candidate caption: an item's own caption (negative=None) or one of its hard negatives."""

    item: int
    text: str
    description: Description | None
    negative: str | None = None


def _judged_bytes(key: tuple, value: tuple[float, str]) -> int:
    """A remembered judgement: the key's text, the feedback's and the objects around them."""
    return len(repr(key)) + sys.getsizeof(value[1]) + 128


class Scorer:
    """Judge -> self-compression -> reward, memoised, with counters for the step metrics (nothing silent)."""

    def __init__(self, judge: Judge, cfg: JudgeConfig):
        self.judge, self.cfg = judge, cfg
        self.cache: BoundedLRU[tuple, tuple[float, str]] = BoundedLRU(64 * 2**20, 262_144, _judged_bytes)
        self.counts: dict[str, float] = {}
        self.gallery: list[dict] = []

    def count(self, name: str, n: float = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def __call__(self, key: tuple, query: View, retrieved: View, truth: View) -> float | None:
        hit = self.cache.get(key)
        if hit is not None:
            self.count("judge/cache_hits")
            return hit[0]
        self.count("judge/calls")
        try:
            feedback = self.judge(query, retrieved, truth)
        except Exception as error:  # a judge failure never stops training: the candidate gets advantage 0
            self.count("judge/failures")
            self.gallery.append({"error": f"{type(error).__name__}: {error}"})
            return None
        if self.cfg.compress:
            feedback, dropped = compress(feedback, self.cfg.penalties)
            self.count("feedback/dropped_reasons", dropped)
        for reason in feedback.reasons:
            self.count(f"feedback/reasons/{reason.attribute}")
        reward = feedback_reward(feedback, self.cfg.verdict_weights, self.cfg.penalties, self.cfg.min_reward)
        self.cache.put(key, (reward, str(feedback)))
        if len(self.gallery) < 8:
            self.gallery.append({"query": query.text or "<image>", "truth": truth.text, "retrieved": retrieved.text,
                                 "feedback": str(feedback), "reward": reward})
        return reward

    def take_counts(self) -> dict[str, float]:
        out, self.counts = self.counts, {}
        return out


@dataclass
class Bank:
    """Detached embeddings of training items (the memory bank), refreshed by the trainer."""

    items: list[int] = field(default_factory=list)
    images: torch.Tensor | None = None
    texts: torch.Tensor | None = None

    def __post_init__(self):
        self.position = {item: row for row, item in enumerate(self.items)}


@dataclass
class StepContext:
    student: TwoTower
    store: InputStore
    items: list[CaptionItem]
    rl: RLConfig
    scorer: Scorer
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    reference: TwoTower | None = None
    bank: Bank | None = None


def item_view(item: CaptionItem) -> View:
    return View(item.caption, item.image, item.description)


def batch_texts(items: list[CaptionItem], idx: list[int], negatives: bool) -> list[TextRef]:
    """The batch's captions (first, in batch order), then its hard negatives when asked."""
    refs = [TextRef(i, items[i].caption, items[i].description) for i in idx]
    if negatives:
        refs += [TextRef(i, n.caption, n.description, n.kind) for i in idx for n in items[i].negatives]
    return refs


def embed_batch(student: TwoTower, store: InputStore, idx: list[int], texts: list[TextRef]):
    return student.embed_images(store.images(idx)), student.embed_texts(store.texts([t.text for t in texts]))


def _judge_group(ctx: StepContext, direction: str, q_item: int, picked: list[int], pool: list) -> list[float | None]:
    """Rewards of the picked candidates of one query. `pool` maps candidate index -> item index (t2i) or TextRef."""
    items, out = ctx.items, []
    truth = items[q_item]
    query = View(text=truth.caption) if direction == "t2i" else View(image=truth.image)
    for c in picked:
        if direction == "t2i":
            cand = items[pool[c]]
            view = item_view(cand)
            ckey = cand.description.key() if cand.description is not None else cand.id
        else:
            ref: TextRef = pool[c]
            view = View(ref.text, None, ref.description)
            ckey = ref.description.key() if ref.description is not None else (ref.item, ref.text)
        tkey = truth.description.key() if truth.description is not None else truth.id
        out.append(ctx.scorer((direction, tkey, ckey), query, view, item_view(truth)))
    return out


def reclip_step(ctx: StepContext, idx: list[int]) -> dict[str, float]:
    """One optimizer step of ReCLIP on the batch `idx` (item indices); returns the step metrics."""
    rl, student = ctx.rl, ctx.student
    b = len(idx)
    # Stage I - collect: embed the batch, build each direction's pool and policy, pick K candidates per query
    texts = batch_texts(ctx.items, idx, rl.text_negatives)
    img, txt = embed_batch(student, ctx.store, idx, texts)
    scale = student.logit_scale.exp()
    tau = rl.temperature or (1.0 / scale.detach())
    sim = img @ txt.T  # [B images, T texts]; texts 0..B-1 are the batch captions
    pools = {
        "t2i": (txt[:b] @ img.T, list(idx)),
        "i2t": (sim, texts),
    }
    if ctx.bank is not None and ctx.bank.items:
        own = torch.tensor([ctx.bank.position.get(i, -1) for i in idx])
        for direction, (s, pool) in list(pools.items()):
            queries = txt[:b] if direction == "t2i" else img
            bank = ctx.bank.images if direction == "t2i" else ctx.bank.texts
            extra = queries @ bank.T
            rows = torch.nonzero(own >= 0).squeeze(1)
            extra[rows, own[rows]] = float("-inf")  # an item in the batch is a candidate once, with gradients
            refs = list(ctx.bank.items) if direction == "t2i" else [
                TextRef(i, ctx.items[i].caption, ctx.items[i].description) for i in ctx.bank.items]
            pools[direction] = (torch.cat([s, extra], 1), pool + refs)
    metrics: dict[str, float] = {}
    loss = torch.zeros(())
    truth_index = torch.arange(b)
    for direction in rl.directions:
        s, pool = pools[direction]
        logp = retrieval_logprobs(s, tau)
        picked = pick_candidates(logp, rl.candidates, rl.selection, ctx.generator,
                                 truth_index if rl.include_truth else None)
        # Stage II - score: the judge's words -> a reward per candidate
        rewards = torch.zeros(picked.shape)
        failed = torch.zeros(picked.shape, dtype=torch.bool)
        for q in range(b):
            for k, r in enumerate(_judge_group(ctx, direction, idx[q], picked[q].tolist(), pool)):
                failed[q, k] = r is None
                rewards[q, k] = 0.0 if r is None else r
        if failed.any():  # a failed judgement gets its group's mean reward: advantage 0
            ok = (~failed).float()
            mean = (rewards * ok).sum(-1, keepdim=True) / ok.sum(-1, keepdim=True).clamp(min=1)
            rewards = torch.where(failed, mean.expand_as(rewards), rewards)
        # Stage III - advantages: r - mean over the K candidates of each query (or the policy-weighted form)
        if rl.advantage == "policy":
            adv = policy_weighted_advantages(logp, picked, rewards)  # sums to 0 per query: centring is a no-op
            adv = group_advantages(adv, normalize=True) if rl.normalize_advantage else adv
        else:
            adv = group_advantages(rewards, rl.normalize_advantage)
        # Stage IV - the loss of this direction
        loss = loss + reinforce_loss(logp, picked, adv)
        top1 = logp.argmax(-1)
        metrics[f"{direction}/reward_mean"] = rewards.mean().item()
        metrics[f"{direction}/batch_R@1"] = (top1 == truth_index).float().mean().item()
        metrics[f"{direction}/zero_advantage_groups"] = (adv.abs().sum(-1) == 0).float().mean().item()
        if ctx.reference is not None and rl.kl_weight > 0:
            loss = loss + rl.kl_weight * _kl_to_reference(ctx, idx, texts, direction, s[:, :logp.shape[1]], tau)
    if rl.anchor_weight > 0:
        nce = info_nce(sim, scale)
        loss = loss + rl.anchor_weight * nce
        metrics["anchor_infonce"] = nce.item()
    grad_norm = _apply(ctx, loss, rl.max_grad_norm)
    metrics.update({"loss": loss.item(), "grad_norm": grad_norm, "logit_scale": scale.item()})
    metrics.update(ctx.scorer.take_counts())
    return metrics


def _kl_to_reference(ctx: StepContext, idx, texts, direction: str, s: torch.Tensor, tau) -> torch.Tensor:
    """KL(pi_ref || pi) over the batch part of the pool (the bank has no reference embeddings)."""
    b = len(idx)
    with torch.no_grad():
        r_img, r_txt = embed_batch(ctx.reference, ctx.store, idx, texts)
        r_sim = r_txt[:b] @ r_img.T if direction == "t2i" else r_img @ r_txt.T
        r_logp = retrieval_logprobs(r_sim, tau)
    width = r_logp.shape[1]
    return distill_kl(retrieval_logprobs(s[:, :width], tau), r_logp)


def infonce_step(ctx: StepContext, idx: list[int], negatives: bool = False) -> dict[str, float]:
    """One optimizer step of symmetric InfoNCE on the batch (the warm-start and the continued baseline); with
    `negatives`, the batch's hard-negative captions are extra text columns (NegCLIP)."""
    texts = batch_texts(ctx.items, idx, negatives)
    img, txt = embed_batch(ctx.student, ctx.store, idx, texts)
    scale = ctx.student.logit_scale.exp()
    loss = info_nce(img @ txt.T, scale)
    grad_norm = _apply(ctx, loss, ctx.rl.max_grad_norm)
    return {"loss": loss.item(), "grad_norm": grad_norm, "logit_scale": scale.item()}


def _apply(ctx: StepContext, loss: torch.Tensor, max_norm: float) -> float:
    ctx.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for g in ctx.optimizer.param_groups for p in g["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    ctx.optimizer.step()
    return float(norm)
