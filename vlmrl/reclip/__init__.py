"""ReCLIP: reinforcement learning for CLIP-style two-tower students, with language feedback from a judge.

Retrieval is the action: a query (caption or image) retrieves K candidates from pi(c | q) = softmax(sim / tau); a
generative reward model says in words why each does or does not match the ground truth; the verdict and the
attribute-level reasons become a reward, and REINFORCE with a per-query mean baseline updates both towers. Only the
student is deployed. See docs/reclip.md.

    from vlmrl.reclip import load_student
    student = load_student("runs/reclip/student")
    student.encode_text(["a red circle to the left of a blue square"]), student.encode_image([pil_image])
"""

import importlib

_EXPORTS = {
    **dict.fromkeys(["Feedback", "Reason", "compress", "feedback_reward", "format_feedback", "parse_feedback"],
                    "vlmrl.reclip.feedback"),
    **dict.fromkeys(["ExactJudge", "Judge", "LLMJudge", "SceneGraphJudge", "View", "build_judge"], "vlmrl.reclip.judge"),
    **dict.fromkeys(["TwoTower", "load_student"], "vlmrl.reclip.students"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):  # PEP 562: loaded on first use, so `vlmrl` commands refused up front never import torch
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'vlmrl.reclip' has no attribute {name!r}")
