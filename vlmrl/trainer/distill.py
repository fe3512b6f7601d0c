"""On-policy distillation: a teacher scores the student's own answers token by token, and the update pushes the
student's log-probability of each token it wrote toward the teacher's.

For an answer y sampled from the student pi_S, token t's advantage gets

    - coef * (log pi_S(y_t | x, y_<t) - log pi_T(y_t | x, y_<t))

the single-sample estimate of the per-token reverse KL(pi_S || pi_T) with no discount (on-policy distillation as
in GKD, Agarwal et al. 2024, and Thinking Machines' 2025 write-up; the loss the recipe's `policy_loss` computes on
these advantages is then the reverse KL's policy gradient). It is added to the verifiable reward's advantage, so a
recipe mixes the two with `distill.coef` (the reward weights set the other side). Both log-probs are taken at the
rollout's temperature, on the same prompt ids and images, in the update's chunks; the teacher is frozen.

The teacher is any policy checkpoint or HF VLM folder the trainer can load (`distill.teacher`), or the URL of a server
that returns prompt log-probs (vlmrl.trainer.served_teacher); it must split text
into the same ids as the student: its tokenizer's whole vocabulary is compared with the student's (size and hash)
and a different one is refused before any step, naming both, since a log-prob of another vocabulary's token id is
a log-prob of another token.
"""

from __future__ import annotations

from torch import Tensor

from vlmrl.errors import ConfigError
from vlmrl.trainer.served_teacher import ServedTeacher, is_served


def check_same_vocabulary(student_tokenizer, teacher_tokenizer, where: str) -> None:
    """ConfigError when the teacher's tokenizer does not split text into the student's ids."""
    from vlmrl.models.reward_model import vocabulary_fingerprint

    mine, theirs = vocabulary_fingerprint(student_tokenizer), vocabulary_fingerprint(teacher_tokenizer)
    if mine != theirs:
        raise ConfigError(
            f"{where}: the teacher's tokenizer is not the student's (vocabulary of {theirs['size']} tokens, sha256 "
            f"{theirs['sha256'][:12]}, against the student's {mine['size']}, {mine['sha256'][:12]}): its log-prob "
            "of a token id would be the log-prob of another token. Use a teacher trained from the same base model "
            "or tokenizer (for the embedded model, the same data and tiny settings)")


class Teacher:
    """The frozen teacher (`logprobs` as `Reference.logprobs`) and the weight of its advantage."""

    stats: dict[str, float] = {}  # nothing to report (a served teacher reports its unscored answers)

    def __init__(self, reference, coef: float):
        self.reference, self.coef = reference, coef

    def logprobs(self, *args, samples=None, student=None, **kwargs) -> Tensor:
        return self.reference.logprobs(*args, **kwargs)


def load_teacher(cfg, policy, device) -> Teacher | None:
    """The frozen teacher of `distill.teacher`, or None without one."""
    from vlmrl.models.policy import load_policy
    from vlmrl.models.preflight import resolve_model
    from vlmrl.models.reference import Reference

    if cfg.distill.teacher is None:
        return None
    if is_served(cfg.distill.teacher):
        d = cfg.distill
        return ServedTeacher(d.teacher, policy, cfg.data.prompt_template, d.coef, d.teacher_model,
                             d.teacher_api_key_env, d.teacher_concurrency)
    m = cfg.model
    path = resolve_model(cfg.distill.teacher, "distill.teacher")
    teacher = load_policy(path, dtype=m.dtype, device=device, min_pixels=m.min_pixels, max_pixels=m.max_pixels,
                          autocast=m.autocast)
    check_same_vocabulary(policy.processor.tokenizer, teacher.processor.tokenizer, f"distill.teacher {path}")
    return Teacher(Reference(policy, teacher), cfg.distill.coef)


def distill_advantages(advantages: Tensor, student: Tensor, teacher: Tensor, mask: Tensor, coef: float
                       ) -> tuple[Tensor, dict[str, float]]:
    """Per-token advantages [N, T]: `advantages` ([N] per answer or [N, T] per token) minus coef x (student -
    teacher) log-probs on answer tokens (`mask`); and the step's metrics: the mean per-token reverse KL estimate
    and the teacher's mean log-prob of the student's tokens."""
    mask = mask.to(student.dtype)
    gap = (student - teacher) * mask
    base = advantages[:, None] * mask if advantages.dim() == 1 else advantages
    tokens = mask.sum().clamp(min=1.0)
    metrics = {"distill/reverse_kl": (gap.sum() / tokens).item(),
               "distill/teacher_logprob": ((teacher * mask).sum() / tokens).item()}
    return base - coef * gap, metrics
