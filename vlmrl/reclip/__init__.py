"""ReCLIP: reinforcement learning for CLIP-style two-tower students, with language feedback from a judge.

Retrieval is the action: a query (caption or image) retrieves K candidates from pi(c | q) = softmax(sim / tau); a
generative reward model says in words why each does or does not match the ground truth; the verdict and the
attribute-level reasons become a reward, and REINFORCE with a per-query mean baseline updates both towers. Only the
student is deployed. See docs/reclip.md.

    from vlmrl.reclip import load_student
    student = load_student("runs/reclip/student")
    student.encode_text(["a red circle to the left of a blue square"]), student.encode_image([pil_image])
"""

from vlmrl.reclip.feedback import Feedback, Reason, compress, feedback_reward, format_feedback, parse_feedback
from vlmrl.reclip.judge import ExactJudge, Judge, LLMJudge, SceneGraphJudge, View, build_judge
from vlmrl.reclip.students import TwoTower, load_student

__all__ = [
    "ExactJudge",
    "Feedback",
    "Judge",
    "LLMJudge",
    "Reason",
    "SceneGraphJudge",
    "TwoTower",
    "View",
    "build_judge",
    "compress",
    "feedback_reward",
    "format_feedback",
    "load_student",
    "parse_feedback",
]
