"""One ReCLIP step in four stages: collect (retrieve K candidates) -> score (the GRM) -> advantages -> update.

For a batch of items, each direction (t2i: a caption retrieves images; i2t: an image retrieves captions) has a
candidate pool: the batch's items (embedded with gradients), optionally the batch's hard-negative captions (i2t) and a
memory bank of earlier-embedded training items (no gradient; their own batch copies masked out). The policy is
pi(c | q) = softmax(sim(q, c) / tau). Both towers receive gradients: the query side in both directions, the candidate
side through the batch part of the pool.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from vlmrl.cache import BoundedLRU
from vlmrl.data.sample import DataError
from vlmrl.data.shapes import render_scene
from vlmrl.reclip.config import JudgeConfig, RLConfig
from vlmrl.reclip.counterfactual import gather
from vlmrl.reclip.feedback import Feedback, compress, feedback_reward
from vlmrl.reclip.judge import Judge, View
from vlmrl.reclip.losses import (
    distill_kl,
    group_advantages,
    info_nce,
    log_policy_advantages,
    pair_loss,
    pick_candidates,
    policy_weighted_advantages,
    reinforce_loss,
    retrieval_logprobs,
)
from vlmrl.reclip.parallel import SINGLE, Parallel
from vlmrl.reclip.scenes import CaptionItem, Description, parse_caption, scene_of
from vlmrl.reclip.store import InputStore
from vlmrl.reclip.students import TwoTower


@dataclass
class TextRef:
    """A candidate caption: an item's own caption (negative=None) or one of its hard negatives."""

    item: int
    text: str
    description: Description | None
    negative: str | None = None


def _judged_bytes(key: tuple, value: tuple[float, Feedback]) -> int:
    """A remembered judgement: the key's text, the feedback's and the objects around them."""
    return len(repr(key)) + 2 * len(str(value[1])) + 256


class Scorer:
    """Judge -> self-compression -> reward, memoised, with counters for the step metrics (nothing silent)."""

    def __init__(self, judge: Judge, cfg: JudgeConfig):
        self.judge, self.cfg = judge, cfg
        self.cache: BoundedLRU[tuple, tuple[float, Feedback]] = BoundedLRU(64 * 2**20, 262_144, _judged_bytes)
        self.counts: dict[str, float] = {}
        self.gallery: list[dict] = []
        self.new: list[tuple[tuple, tuple[float, Feedback]]] = []  # this step's fresh judgements (shared across ranks)
        self._ready: dict[tuple, Feedback | Exception] = {}  # prefetched judgements, taken by __call__

    def count(self, name: str, n: float = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def prefetch(self, requests: list[tuple[tuple, View, View, View]]) -> None:
        """Judge the requests' uncached keys at once, `judge.options.concurrency` (default 8) in flight, for a judge
        behind an endpoint (`remote`); a programmatic judge is judged inline by `__call__`."""
        if not getattr(self.judge, "remote", False):
            return
        todo = {key: views for key, *views in requests if self.cache.get(key) is None}
        workers = int(self.cfg.options.get("concurrency", 8))
        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="reclip-judge") as pool:
            futures = {key: pool.submit(self._judge, *views) for key, views in todo.items()}
        self._ready = {key: future.result() for key, future in futures.items()}

    def _judge(self, query: View, retrieved: View, truth: View) -> Feedback | Exception:
        try:
            return self.judge(query, retrieved, truth)
        except Exception as error:  # a judge failure never stops training: the candidate gets advantage 0
            return error

    def __call__(self, key: tuple, query: View, retrieved: View, truth: View) -> tuple[float, Feedback] | None:
        """(reward, the compressed feedback) of one judged candidate; None when the judge failed (counted)."""
        hit = self.cache.get(key)
        if hit is not None:
            self.count("judge/cache_hits")
            return hit
        self.count("judge/calls")
        feedback = self._ready.pop(key) if key in self._ready else self._judge(query, retrieved, truth)
        if isinstance(feedback, Exception):
            self.count("judge/failures")
            self.gallery.append({"error": f"{type(feedback).__name__}: {feedback}"})
            return None
        if self.cfg.compress:
            feedback, dropped = compress(feedback, self.cfg.penalties)
            self.count("feedback/dropped_reasons", dropped)
        for reason in feedback.reasons:
            self.count(f"feedback/reasons/{reason.attribute}")
        reward = feedback_reward(feedback, self.cfg.verdict_weights, self.cfg.penalties, self.cfg.min_reward)
        self.cache.put(key, (reward, feedback))
        self.new.append((key, (reward, feedback)))
        if len(self.gallery) < 8:
            self.gallery.append({"query": query.text or "<image>", "truth": truth.text, "retrieved": retrieved.text,
                                 "feedback": str(feedback), "reward": reward})
        return reward, feedback

    def take_counts(self) -> dict[str, float]:
        out, self.counts = self.counts, {}
        return out

    def share(self, par: Parallel) -> None:
        """Every rank's fresh judgements of this step into every rank's memo (one process: nothing to do)."""
        new, self.new = self.new, []
        if par.world > 1:
            for key, value in par.share(new):
                if self.cache.get(key) is None:
                    self.cache.put(key, value)


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
    par: Parallel = SINGLE  # under torchrun: this rank's share of the rows (vlmrl.reclip.parallel)
    precision: str = "fp32"  # "bf16": the towers under autocast (trainer.precision)


def item_view(item: CaptionItem) -> View:
    return View(item.caption, item.image, item.description)


def batch_texts(items: list[CaptionItem], idx: list[int], negatives: bool) -> list[TextRef]:
    """The batch's captions (first, in batch order), then its hard negatives when asked."""
    refs = [TextRef(i, items[i].caption, items[i].description) for i in idx]
    if negatives:
        refs += [TextRef(i, n.caption, n.description, n.kind) for i in idx for n in items[i].negatives]
    return refs


def precision_context(student: TwoTower, precision: str):
    """bf16: the towers run under torch.autocast on the student's device (the similarities and losses stay fp32)."""
    device = next(student.parameters()).device.type
    return torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16")


def embed_batch(student: TwoTower, store: InputStore, idx: list[int], texts: list[TextRef], par: Parallel = SINGLE,
                grad: bool = True, precision: str = "fp32"):
    """The batch's image and text embeddings (fp32), every row on every rank (each rank embeds its share; see
    parallel), the towers in `precision`."""
    def images(rows):
        with precision_context(student, precision):
            return student.embed_images(store.images(rows)).float()

    def captions(rows):
        with precision_context(student, precision):
            return student.embed_texts(store.texts([t.text for t in rows])).float()

    return par.embed(images, list(idx), grad), par.embed(captions, texts, grad)


def _requests(ctx: StepContext, direction: str, q_item: int, picked: list[int],
              pool: list) -> list[tuple[tuple, View, View, View]]:
    """(memo key, query, retrieved, truth) of the picked candidates of one query. `pool` maps candidate index ->
    item index (t2i) or TextRef."""
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
        out.append(((direction, tkey, ckey), query, view, item_view(truth)))
    return out


def reclip_step(ctx: StepContext, idx: list[int]) -> dict[str, float]:
    """One optimizer step of ReCLIP on the batch `idx` (item indices); returns the step metrics."""
    rl, student, par = ctx.rl, ctx.student, ctx.par
    b = len(idx)
    lo, hi = par.rows(b)  # this rank judges and takes the loss of queries lo..hi-1 (one process: all)
    # Stage I - collect: embed the batch, build each direction's pool and policy, pick K candidates per query
    texts = batch_texts(ctx.items, idx, rl.text_negatives)
    img, txt = embed_batch(student, ctx.store, idx, texts, par, precision=ctx.precision)
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
            if direction not in rl.bank_directions:
                continue
            queries = txt[:b] if direction == "t2i" else img
            bank = ctx.bank.images if direction == "t2i" else ctx.bank.texts
            extra = queries @ bank.T
            rows = torch.nonzero(own >= 0).squeeze(1)
            extra[rows, own[rows]] = float("-inf")  # an item in the batch is a candidate once, with gradients
            refs = list(ctx.bank.items) if direction == "t2i" else [
                TextRef(i, ctx.items[i].caption, ctx.items[i].description) for i in ctx.bank.items]
            pools[direction] = (torch.cat([s, extra], 1), pool + refs)
    metrics: dict[str, float] = {}  # means over the queries (every rank: its share, then the mean over the ranks)
    sums: dict[str, float] = {}  # summed over the ranks: the loss (each rank's share of it) and counts
    loss = torch.zeros(())
    truth_index = torch.arange(b)
    confusions: list[list[Feedback]] = [[] for _ in range(b)]  # per query item: feedback on its likeliest misses
    for direction in rl.directions:
        s, pool = pools[direction]
        logp = retrieval_logprobs(s, tau)
        picked = pick_candidates(logp, rl.candidates, rl.selection, ctx.generator,
                                 truth_index if rl.include_truth else None)  # every rank: the same global picks
        logp, picked = logp[lo:hi], picked[lo:hi]
        # Stage II - score: the judge's words -> a reward per candidate
        rewards = torch.zeros(picked.shape)
        failed = torch.zeros(picked.shape, dtype=torch.bool)
        requests = [_requests(ctx, direction, idx[lo + q], picked[q].tolist(), pool) for q in range(hi - lo)]
        ctx.scorer.prefetch([r for group in requests for r in group])  # an endpoint's judge: calls in flight at once
        for q, group in enumerate(requests):
            judged = [ctx.scorer(*request) for request in group]
            for k, r in enumerate(judged):
                failed[q, k] = r is None
                rewards[q, k] = 0.0 if r is None else r[0]
            if rl.counterfactuals:  # the misses' feedback, the student's likeliest candidates first
                order = logp[q].gather(-1, picked[q]).argsort(descending=True).tolist()
                confusions[lo + q] += [judged[k][1] for k in order if judged[k] is not None and judged[k][1].reasons]
        if failed.any():  # a failed judgement gets its group's mean reward: advantage 0
            ok = (~failed).float()
            mean = (rewards * ok).sum(-1, keepdim=True) / ok.sum(-1, keepdim=True).clamp(min=1)
            rewards = torch.where(failed, mean.expand_as(rewards), rewards)
        # Stage III - advantages: r - mean over the K candidates of each query (or the policy-weighted form)
        if rl.advantage in ("policy", "log"):  # both sum to 0 per query: centring is a no-op
            weighted = policy_weighted_advantages if rl.advantage == "policy" else log_policy_advantages
            adv = weighted(logp, picked, rewards)
            adv = group_advantages(adv, normalize=True) if rl.normalize_advantage else adv
        else:
            adv = group_advantages(rewards, rl.normalize_advantage)
        # Stage IV - the loss of this direction (this rank's queries; the mean is over the global batch)
        loss = loss + reinforce_loss(logp, picked, adv) * (hi - lo) / b
        top1 = logp.argmax(-1)
        metrics[f"{direction}/reward_mean"] = rewards.mean().item()
        metrics[f"{direction}/batch_R@1"] = (top1 == truth_index[lo:hi]).float().mean().item()
        metrics[f"{direction}/zero_advantage_groups"] = (adv.abs().sum(-1) == 0).float().mean().item()
        if ctx.reference is not None and rl.kl_weight > 0:
            loss = loss + rl.kl_weight * _kl_to_reference(ctx, idx, texts, direction, s, tau, (lo, hi))
    if rl.anchor_weight > 0:
        image_extra = None
        pairs = None
        if rl.counterfactuals:  # the reasons, applied to each truth's caption: its own extra negative columns
            text_cf, image_extra, pairs = _counterfactual_sims(ctx, idx, img, txt[:b], confusions, sums)
            sim = torch.cat([sim, text_cf], 1)
        nce = info_nce(sim, scale, rows=(lo, hi), image_extra=image_extra)
        loss = loss + rl.anchor_weight * nce
        sums["anchor_infonce"] = nce.item()
        if pairs is not None:
            loss = loss + rl.anchor_weight * rl.counterfactual_pairs * pairs
            sums["counterfactual/pair_loss"] = pairs.item()
    grad_norm = _apply(ctx, loss, rl.max_grad_norm)
    sums["loss"] = loss.item()
    ctx.scorer.share(par)
    metrics = par.mean(metrics)
    metrics.update(par.sum({**sums, **ctx.scorer.take_counts()}))
    metrics.update({"grad_norm": grad_norm, "logit_scale": scale.item()})
    return metrics


def _counterfactual_sims(ctx: StepContext, idx: list[int], img: torch.Tensor, txt: torch.Tensor,
                         confusions: list[list[Feedback]], sums: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step's counterfactuals as extra anchor columns: [B, M] similarities of the batch images with the M
    counterfactual captions (each truth's caption edited by the reasons of its likeliest misses, up to
    rl.counterfactuals per truth), and with rl.counterfactual_images, [B, N] similarities of the batch captions `txt`
    with N new scenes drawn from the first of those captions (None without). A column belongs to its own truth's row
    only (elsewhere -1e4, far below any cosine: an edit of one caption may well describe another batch item; not
    -inf, whose product with the scale's gradient would be NaN)."""
    owners, texts, unrouted = [], [], 0
    drawn: list[tuple[int, str]] = []  # (row, counterfactual caption) to draw as a scene
    for row, (item, feedbacks) in enumerate(zip(idx, confusions, strict=True)):
        if not feedbacks:  # another rank's query (or no judged miss)
            continue
        made, missed = gather(ctx.items[item].caption, feedbacks, ctx.rl.counterfactuals)
        drawn += [(row, text, len(texts) + k) for k, text in enumerate(made[:ctx.rl.counterfactual_images])]
        owners += [row] * len(made)
        texts += made
        unrouted += missed
    sums["counterfactual/captions"] = len(texts) / len(idx)  # this rank's share of the mean per truth
    sums["counterfactual/unrouted_reasons"] = unrouted
    text_cols, cf = img.new_zeros((len(idx), 0)), None
    if not texts and ctx.par.sharded:  # a sharded tower's forward needs every rank: a column no row owns (masked,
        texts, owners = [ctx.items[idx[0]].caption], [-1]  # so it changes neither the loss nor any gradient)
    if texts:
        with precision_context(ctx.student, ctx.precision):
            cf = ctx.student.embed_texts(ctx.store.texts(texts)).float()
        own = torch.tensor(owners)[None, :] == torch.arange(len(idx))[:, None]
        text_cols = (img @ cf.T).masked_fill(~own, -1.0e4)
    if not ctx.rl.counterfactual_images:
        return text_cols, None, None
    scenes = []  # (row, key, side, objects, the caption's index in texts): the same key always draws the same scene
    for row, text, k in drawn:
        item = ctx.items[idx[row]]
        desc, side = parse_caption(text), item.image.width
        try:
            objects = None if desc is None else scene_of(desc, random.Random(f"counterfactual|{item.id}|{text}"), side)
        except DataError:  # does not fit the canvas
            objects = None
        if objects is not None:
            scenes.append((row, f"{item.id}|{text}", side, objects, k))
    sums["counterfactual/images"] = len(scenes) / len(idx)
    sums["counterfactual/undrawn_captions"] = len(drawn) - len(scenes)
    if not scenes:
        return text_cols, txt.new_zeros((len(idx), 0)), None

    def draw(side: int, objects: list[dict]):
        return lambda: render_scene(side, objects)

    made = ctx.store.rendered([(key, draw(side, objects)) for _, key, side, objects, _ in scenes])
    with precision_context(ctx.student, ctx.precision):
        cf_img = ctx.student.embed_images(made).float()
    rows = torch.tensor([row for row, *_ in scenes])
    own = rows[None, :] == torch.arange(len(idx))[:, None]
    pairs = None
    if ctx.rl.counterfactual_pairs:  # each scene and its own caption, a pair against the truth's, both ways
        cf_txt = cf[torch.tensor([k for *_, k in scenes])]
        pairs = pair_loss(cf_img, cf_txt, img[rows], txt[rows], ctx.student.logit_scale.exp(), len(idx))
    return text_cols, (txt @ cf_img.T).masked_fill(~own, -1.0e4), pairs


def _kl_to_reference(ctx: StepContext, idx, texts, direction: str, s: torch.Tensor, tau,
                     rows: tuple[int, int]) -> torch.Tensor:
    """KL(pi_ref || pi) over the batch part of the pool (the bank has no reference embeddings), for the queries
    `rows` (this rank's), as their share of the mean over the batch."""
    b, (lo, hi) = len(idx), rows
    with torch.no_grad():
        r_img, r_txt = embed_batch(ctx.reference, ctx.store, idx, texts, ctx.par, grad=False, precision=ctx.precision)
        r_sim = r_txt[:b] @ r_img.T if direction == "t2i" else r_img @ r_txt.T
        r_logp = retrieval_logprobs(r_sim[lo:hi], tau)
    width = r_logp.shape[1]
    return distill_kl(retrieval_logprobs(s[lo:hi, :width], tau), r_logp) * (hi - lo) / b


def infonce_step(ctx: StepContext, idx: list[int], negatives: bool = False) -> dict[str, float]:
    """One optimizer step of symmetric InfoNCE on the batch (the warm-start and the continued baseline); with
    `negatives`, the batch's hard-negative captions are extra text columns (NegCLIP)."""
    texts = batch_texts(ctx.items, idx, negatives)
    img, txt = embed_batch(ctx.student, ctx.store, idx, texts, ctx.par, precision=ctx.precision)
    scale = ctx.student.logit_scale.exp()
    loss = info_nce(img @ txt.T, scale, rows=ctx.par.rows(len(idx)))
    grad_norm = _apply(ctx, loss, ctx.rl.max_grad_norm)
    return {**ctx.par.sum({"loss": loss.item()}), "grad_norm": grad_norm, "logit_scale": scale.item()}


def _apply(ctx: StepContext, loss: torch.Tensor, max_norm: float) -> float:
    ctx.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for g in ctx.optimizer.param_groups for p in g["params"]]
    ctx.par.sum_gradients(params)  # each rank's loss is its share of the batch's: the sum is the whole gradient
    norm = ctx.par.clip_gradients(params, max_norm if max_norm > 0 else float("inf"))
    ctx.optimizer.step()
    return norm
