"""ReCLIP's math as pure functions: the retrieval policy, candidate picking, advantages, REINFORCE, InfoNCE, KL.

Notation: a similarity matrix `sim` [Q, C] holds cosine similarities of Q queries with C candidates; the retrieval
policy is pi(c | q) = softmax_c(sim[q] / tau).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def retrieval_logprobs(sim: torch.Tensor, tau: torch.Tensor | float) -> torch.Tensor:
    """log pi(c | q) = log_softmax(sim / tau) over candidates (last dim); [Q, C]."""
    return torch.log_softmax(sim / tau, dim=-1)


def pick_candidates(logp: torch.Tensor, k: int, mode: str = "sample", generator: torch.Generator | None = None,
                    force: torch.Tensor | None = None) -> torch.Tensor:
    """K candidate indices per query [Q, K], distinct within a query.

    mode "sample": drawn from pi without replacement; "topk": the K most probable. With `force` [Q], that index (the
    ground truth) takes the last slot when it was not picked, so every group holds the right answer.
    """
    if not 1 <= k <= logp.shape[-1]:
        raise ValueError(f"rl.candidates must be 1..{logp.shape[-1]} (the candidate pool), got {k}")
    with torch.no_grad():
        if mode == "topk":
            picked = logp.topk(k, dim=-1).indices
        elif mode == "sample":
            picked = torch.multinomial(logp.float().exp(), k, replacement=False, generator=generator)
        else:
            raise ValueError(f"rl.selection must be 'sample' or 'topk', got {mode!r}")
        if force is not None:
            missing = ~(picked == force[:, None]).any(-1)
            picked[missing, -1] = force[missing]
    return picked


def group_advantages(rewards: torch.Tensor, normalize: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """A = r - mean over the K candidates of each query (rows of [Q, K]); divided by the row's std when
    `normalize`. A row of equal rewards gives zeros, never NaN."""
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if not normalize:
        return centred
    std = rewards.std(dim=-1, keepdim=True, unbiased=False)
    return torch.where(std > eps, centred / (std + eps), torch.zeros_like(centred))


def policy_weighted_advantages(logp: torch.Tensor, candidates: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """The exact policy gradient of the expected reward over each query's K candidates, as REINFORCE advantages.

    With pi_K(c) = pi(c) / sum_k pi(c_k) the policy renormalised on the K candidates and b = sum_k pi_K(c_k) r_k:
    A_k = K * pi_K(c_k) * (r_k - b), so that -sum_k A_k log pi(c_k) has the gradient of -K * E_{pi_K}[r]. A candidate
    the student finds likely weighs in proportion, as a negative does in InfoNCE; the truth, placed in the group
    whatever its probability (`include_truth`), weighs by its own probability instead of 1. Sums to 0 per query.
    """
    with torch.no_grad():
        weights = torch.softmax(logp.gather(-1, candidates), dim=-1)
        baseline = (weights * rewards).sum(-1, keepdim=True)
        return candidates.shape[-1] * weights * (rewards - baseline)


def log_policy_advantages(logp: torch.Tensor, candidates: torch.Tensor, rewards: torch.Tensor,
                          eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE advantages whose loss has the gradient of -log(E_{pi_K}[r] - min_k r_k) per query:

        A_k = pi_K(c_k) (r_k - b) / (b - min_k r_k),   b = sum_k pi_K(c_k) r_k

    (pi_K: pi renormalised on the K candidates). With rewards 1 (relevant) and 0 this is the cross-entropy of the
    relevant candidates among the K, gradient -pi_K(c) on a miss c: a confused query (the truth unlikely) still
    pushes its likeliest misses down at full strength, where the expected reward's gradient
    (`policy_weighted_advantages`) scales them by the truth's small probability. Subtracting the group's lowest
    reward makes it invariant to a shift of the rewards. A group of equal rewards gives zeros. Sums to 0 per query.
    """
    with torch.no_grad():
        weights = torch.softmax(logp.gather(-1, candidates), dim=-1)
        baseline = (weights * rewards).sum(-1, keepdim=True)
        floor = rewards.min(-1, keepdim=True).values
        return weights * (rewards - baseline) / (baseline - floor).clamp(min=eps)


def reinforce_loss(logp: torch.Tensor, candidates: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """L = mean_q [ -sum_k A[q, k] * log pi(c_k | q) ].

    Its gradient on sim[q, j] is -(1 / (Q tau)) sum_k A[q, k] (1[j = c_k] - pi(j | q)): with advantages that sum to
    zero over k, only the picked candidates move, each by its own advantage.
    """
    picked = logp.gather(-1, candidates)
    return -(advantages.detach() * picked).sum(-1).mean()


def info_nce(sim: torch.Tensor, scale: torch.Tensor | float, targets: torch.Tensor | None = None,
             rows: tuple[int, int] | None = None, image_extra: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric InfoNCE of CLIP on [B, C] image-text similarities (C >= B: extra columns are extra texts, e.g. hard
    negatives): ( CE(scale * sim, t) over texts + CE(scale * [sim[:, :B].T | image_extra], t) over images ) / 2,
    t = arange(B); `image_extra` [B captions, N]: each caption's similarity to N more images (e.g. counterfactual
    scenes), extra columns of the text-to-image term.

    `rows` = (lo, hi): only the terms of images lo..hi-1 and captions lo..hi-1, as their share of the mean over B
    (the shares of disjoint row ranges sum to the whole loss: how ranks split it, vlmrl.reclip.parallel)."""
    b = sim.shape[0]
    targets = torch.arange(b, device=sim.device) if targets is None else targets
    logits = sim * scale
    per_caption = logits[:, :b].t()
    if image_extra is not None:
        per_caption = torch.cat([per_caption, image_extra * scale], 1)
    if rows is None:
        return 0.5 * (F.cross_entropy(logits, targets) + F.cross_entropy(per_caption, targets))
    lo, hi = rows
    t = targets[lo:hi]
    return 0.5 * (F.cross_entropy(logits[lo:hi], t, reduction="sum")
                  + F.cross_entropy(per_caption[lo:hi], t, reduction="sum")) / b


def pair_loss(scene: torch.Tensor, caption: torch.Tensor, truth_image: torch.Tensor, truth_caption: torch.Tensor,
              scale: torch.Tensor | float, batch: int) -> torch.Tensor:
    """Counterfactual pairs, both ways, as their share of the mean over a batch of `batch` truths: for each of the N
    rows (unit embeddings [N, D]), a drawn scene and the caption it was drawn from against the truth's pair:
    ( CE(scale * [s.c, s.truth_caption], 0) + CE(scale * [c.s, c.truth_image], 0) ) / 2, summed, / batch."""
    match = (scene * caption).sum(-1)
    i2t = torch.stack([match, (scene * truth_caption).sum(-1)], 1)  # the scene: its caption, or the truth's?
    t2i = torch.stack([match, (caption * truth_image).sum(-1)], 1)  # the caption: its scene, or the truth's image?
    target = torch.zeros(len(scene), dtype=torch.long, device=scene.device)
    return 0.5 * (F.cross_entropy(scale * i2t, target, reduction="sum")
                  + F.cross_entropy(scale * t2i, target, reduction="sum")) / batch


def distill_kl(logp_student: torch.Tensor, logp_reference: torch.Tensor) -> torch.Tensor:
    """KL(pi_ref || pi_student) per query, averaged: sum_c pi_ref (log pi_ref - log pi_student). Keeps the
    retrieval distributions near the starting student's so representations do not collapse."""
    p_ref = logp_reference.exp()
    return (p_ref * (logp_reference - logp_student)).sum(-1).mean()
