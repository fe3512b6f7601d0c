"""Off-policy correction: the gap between the policy that sampled an answer and the one the update trains.

Three policies meet in an update. The *behaviour* policy mu sampled the answer (the built-in sampler or vLLM, with
its own kernels and precision, possibly some versions behind under `rollout.asynchronous`); its log-probs come with
every rollout (`Rollout.logprobs`). The *proximal* policy pi_prox is the trainer's weights before the update, scored
with the training forward; PPO's ratio pi_theta / pi_prox is taken against it (`algorithm.ratio_denominator:
proximal`, the default), or against mu itself (`behaviour`, verl's "bypass" mode: no recomputation, and the clip
then bounds the whole off-policy ratio). The trained policy pi_theta has the gradient.

With the proximal denominator the clip does not see mu, so the sampler–trainer gap is corrected by a per-token weight
w_t (detached) that multiplies the policy-gradient loss (Fu et al. 2025, AReaL's decoupled PPO; Yao et al. 2025,
"Your efficient RL framework secretly brings you off-policy RL training"). With delta_t = log pi_prox(y_t) -
log mu(y_t) on the answer's tokens, rho_t = exp(delta_t) and the sequence ratio rho = exp(sum_t delta_t):

    token_tis      w_t = min(rho_t, C)                                 truncated IS per token      (C = high, 2)
    sequence_tis   w_t = min(rho, C)                                   truncated IS per answer     (C = high, 2)
    mis            w_t = rho if rho <= C else 0                        masked IS per answer        (C = high, 3)
    icepop         w_t = rho_t if low <= rho_t <= high else 0          token masking, two-sided    ([0.5, 5])
    geometric      w_t = 1 if low <= exp(mean_t delta_t) <= high else 0   answer rejection by the
                                                                       geometric mean ratio        ([0.999, 1.001])

Sources: TIS as in Yao et al. 2025 and verl's `rollout_is: token` (cap 2); sequence TIS and MIS as TRL's
`vllm_importance_sampling_mode` "sequence_truncate" / "sequence_mask" (TRL's default, cap 3); IcePop from the Ring-1T
report (inclusionAI 2025), bounds [0.5, 5]; geometric-mean rejection as verl's `rollout_rs: geometric`
([0.999, 1.001]). `auto` (the default) is `token_tis` with cap 2 (verl's default) where the sampler is not the
trainer (rollout.engine=vllm, or rollout.asynchronous with max_staleness > 0): on stale answers it was the one
correction that recovered accuracy (BENCHMARKS.md, "Off-policy correction"), where TRL's default MIS did not; and none
with the built-in synchronous sampler, whose log-probs equal the trainer's up to rounding: the correction would only
add that rounding to the loss.

Under truncation the estimator is biased by exactly the truncated mass, E_mu[(rho - C)^+ A grad log pi]; under
masking by the masked mass. tests/test_correction.py shows both on a policy small enough to enumerate.

Log-probs are on the same support only without top-k/top-p: the trainer scores the unfiltered tempered distribution
softmax(logits / T), the sampler draws from the filtered one. Corrections and the behaviour denominator are refused
with a filter on (a config rule, `vlmrl.config`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlmrl.config import DEFAULT_BOUNDS, Correction, resolve_correction  # noqa: F401  (re-exported: a recipe's choice)
from vlmrl.errors import ConfigError

CORRECTIONS = ("none", "token_tis", "sequence_tis", "mis", "icepop", "geometric")
LOG_RATIO_CLAMP = 20.0  # as in losses.importance_ratio: exp of a wild log-ratio must not overflow


def log_ratios(proximal: Tensor, behaviour: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(the mask as floats, delta_t = log pi_prox - log mu on it, clamped to +-LOG_RATIO_CLAMP), detached."""
    m = mask.to(proximal.dtype)
    return m, ((proximal.detach() - behaviour.to(proximal.device)) * m).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def correction_weights(proximal: Tensor, behaviour: Tensor, mask: Tensor, correction: Correction) -> Tensor:
    """Per-token weights w [N, T] (detached, 0 off the mask) that multiply the policy-gradient loss; see the module
    docstring for each method's formula. `proximal`, `behaviour`: [N, T] log-probs of the sampled tokens."""
    m, delta = log_ratios(proximal, behaviour, mask)
    method, low, high = correction
    if method in ("token_tis", "icepop"):
        rho = delta.exp()
        if method == "token_tis":
            w = rho.clamp(max=high)
        else:
            keep = torch.ones_like(rho, dtype=torch.bool)
            if low is not None:
                keep &= rho >= low
            if high is not None:
                keep &= rho <= high
            w = rho * keep
        return w * m
    seq_log = delta.sum(-1, keepdim=True)
    if method == "geometric":
        g = (seq_log / m.sum(-1, keepdim=True).clamp(min=1)).exp()
        keep = torch.ones_like(g, dtype=torch.bool)
        if low is not None:
            keep &= g >= low
        if high is not None:
            keep &= g <= high
        return keep.to(m.dtype).expand_as(m) * m
    rho = seq_log.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    if method == "sequence_tis":
        w = rho.clamp(max=high)
    elif method == "mis":
        w = rho * (rho <= high)
    else:
        raise ConfigError(f"algorithm.rollout_correction={method!r}: expected one of {', '.join(CORRECTIONS)}")
    return w.expand_as(m) * m


def raw_ratios(proximal: Tensor, behaviour: Tensor, mask: Tensor, method: str) -> Tensor:
    """[N, T] the ratio each method weighs with before its bound: rho_t (token methods), rho of the answer (sequence
    methods), 1 (geometric rejection only keeps or drops)."""
    m, delta = log_ratios(proximal, behaviour, mask)
    if method in ("token_tis", "icepop"):
        return delta.exp() * m
    if method == "geometric":
        return m.clone()
    return delta.sum(-1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().expand_as(m) * m


def policy_turns(mask: Tensor) -> Tensor:
    """[N, T] long: the turn (1, 2, ...) of each policy token, 0 off the mask. A multi-turn trajectory's mask is
    policy turn | observation | policy turn ...; a new turn starts at every 0 -> 1 step of the mask."""
    m = mask.bool()
    starts = m & ~torch.nn.functional.pad(m, (1, 0))[:, :-1]
    return torch.cumsum(starts.long(), -1) * m


def mismatch_metrics(proximal: Tensor, behaviour: Tensor, mask: Tensor, correction: Correction,
                     prompt_images: Tensor | None = None) -> dict[str, float]:
    """The sampler–trainer gap of one update's answers, on their policy tokens (mask):

    - `mismatch/k1`, `mismatch/k3`: KL(mu || pi_prox) estimated from mu's own samples, k1 = E[log mu - log pi] and
      k3 = E[rho - 1 - log rho] with rho = pi_prox / mu (non-negative per token; the better estimate when small);
    - `mismatch/ratio_mean|min|max`: rho_t over the tokens;
    - `mismatch/ess`: the effective sample share of the answers' sequence ratios, (sum rho)^2 / (n sum rho^2), 1 when
      every answer weighs the same;
    - with a correction on: `mismatch/masked_fraction` (tokens whose weight is 0) and `mismatch/clipped_fraction`
      (tokens whose weight was truncated);
    - k1 and k3 again per number of images in the prompt (`.../images_K`, with `prompt_images` [N]) and, for
      multi-turn trajectories, per turn (`.../turn_K`).
    """
    m = mask.bool()
    if not m.any():
        return {}
    delta = log_ratios(proximal.float(), behaviour.float(), mask)[1]
    rho = delta.exp()
    k3 = rho - 1 - delta
    out = {"mismatch/k1": (-delta[m]).mean().item(), "mismatch/k3": k3[m].mean().item(),
           "mismatch/ratio_mean": rho[m].mean().item(), "mismatch/ratio_min": rho[m].min().item(),
           "mismatch/ratio_max": rho[m].max().item()}
    rows = m.any(-1)
    seq = delta.sum(-1)[rows].clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).double().exp()
    out["mismatch/ess"] = (seq.sum() ** 2 / (len(seq) * (seq ** 2).sum())).item()
    if correction.method != "none":
        w = correction_weights(proximal.float(), behaviour.float(), mask, correction)
        raw = raw_ratios(proximal.float(), behaviour.float(), mask, correction.method)
        tokens = m.sum().item()
        out["mismatch/masked_fraction"] = ((w == 0) & m).sum().item() / tokens
        out["mismatch/clipped_fraction"] = ((w > 0) & (w != raw) & m).sum().item() / tokens
    splits = []
    if prompt_images is not None:
        images = prompt_images.to(m.device)[:, None].expand_as(m)
        splits += [(f"images_{k}", m & (images == k)) for k in sorted(set(prompt_images.tolist()))]
    turns = policy_turns(m)
    if turns.max() > 1:
        splits += [(f"turn_{t}", turns == t) for t in range(1, int(turns.max()) + 1)]
    for name, part in splits:
        if part.any():
            out[f"mismatch/k1/{name}"] = (-delta[part]).mean().item()
            out[f"mismatch/k3/{name}"] = k3[part].mean().item()
    return out
