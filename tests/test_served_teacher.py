"""On-policy distillation from a served teacher (vlmrl/trainer/served_teacher.py): `vlmrl serve` of a teacher
checkpoint scores the student's answers over HTTP with vLLM's prompt_logprobs, and every answer whose ids the
teacher read as the student wrote them gets the local teacher's log-probs; the others are counted, never guessed."""

from __future__ import annotations

import pytest
import torch

from tests.test_distill import steps
from tests.test_serve_chat import running
from tests.test_train_e2e import SMALL
from vlmrl.cli import main
from vlmrl.config import load_config
from vlmrl.data import make_task
from vlmrl.errors import ConfigError
from vlmrl.models import load_policy
from vlmrl.models.preflight import resolve_model
from vlmrl.rollout.batch import make_prompts
from vlmrl.rollout.generate import generate
from vlmrl.serve.chat import chat_app, load_chat_model
from vlmrl.serve.guard import ServeLimits
from vlmrl.trainer.distill import load_teacher

BASE = ["train", *SMALL, "algorithm.overlong_filter=false", "rollout.max_new_tokens=12", "rollout.group_size=4",
        "algorithm.dynamic_sampling=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    teacher, student = root / "teacher", root / "student"
    assert main([*BASE, f"trainer.output_dir={teacher}", "sft.steps=60", "trainer.steps=1"]) == 0
    assert main([*BASE, f"trainer.output_dir={student}", "sft.steps=30", "trainer.steps=1"]) == 0
    return teacher, student


@pytest.fixture(scope="module")
def served(runs):
    # the client sends the user text the student saw (its template applied): the server templates nothing more
    model = load_chat_model(runs[0], model_name="teacher", prompt_template="{problem}")
    with running(chat_app(model, ServeLimits(max_tokens=16, max_body_bytes=4_000_000))) as url:
        yield f"{url}/v1"


def test_a_served_teacher_scores_what_the_local_one_does(runs, served):
    teacher_dir, student_dir = runs
    cfg = load_config(student_dir / "checkpoint-1" / "config.yaml", [])
    student = load_policy(resolve_model(student_dir, "student"))
    samples = make_task("shapes_count", 6, "test", seed=3)
    prompts = make_prompts(student, samples, cfg.data.prompt_template)
    rollout = generate(student, prompts, 4, 12, 1.0, generator=torch.Generator().manual_seed(0))
    args = (prompts, rollout.prompt_index, rollout.completion_ids, rollout.completion_mask, 1.0)
    mask = rollout.completion_mask.bool()
    cfg.distill.teacher = str(teacher_dir)
    local = load_teacher(cfg, student, "cpu").logprobs(*args)
    cfg.distill.teacher = served
    remote = load_teacher(cfg, student, "cpu")
    assert remote.model == "teacher"  # the only model GET /models lists
    marker = torch.full_like(local, 7.0)  # the "student's" log-probs: what an unscored answer keeps
    got = remote.logprobs(*args, samples=samples, student=marker)
    tokenizer, eos = student.processor.tokenizer, set(student.eos_token_ids)
    canonical = 0
    for n in range(len(got)):
        ids = rollout.completion_ids[n][mask[n]].tolist()
        body = ids[:-1] if ids and ids[-1] in eos else ids
        if tokenizer.encode(tokenizer.decode(body), add_special_tokens=False) == body:  # the teacher reads these ids
            canonical += 1
            assert torch.allclose(got[n][mask[n]], local[n][mask[n]], atol=1e-4), n
        else:  # spelt with ids the tokenizer would not choose: unscored, the student's values kept
            assert torch.equal(got[n][mask[n]], marker[n][mask[n]]), n
    assert 0 < canonical < len(got)  # both cases met (this small student spells most answers unlike its tokenizer)
    assert remote.stats["distill/unscored"] == pytest.approx(1 - canonical / len(got))


def test_vlmrl_train_distils_from_a_served_teacher(runs, served, tmp_path):
    run = tmp_path / "run"
    assert main([*BASE, f"trainer.output_dir={run}", "sft.steps=30", "trainer.steps=2", f"distill.teacher={served}",
                 "distill.teacher_model=teacher"]) == 0
    rows = steps(run)
    assert len(rows) == 2 and all(0 <= r["distill/unscored"] <= 1 and r["distill/teacher_logprob"] < 0 for r in rows)
    # answers were scored over HTTP (this small student spells most of its answers unlike its tokenizer: counted)
    assert sum(1 - r["distill/unscored"] for r in rows) > 0 and any(abs(r["distill/reverse_kl"]) > 1e-5 for r in rows)


def test_a_served_teacher_needs_temperature_one_and_a_single_turn():
    with pytest.raises(ConfigError, match="a server returns log-probs at temperature 1"):
        load_config(None, ["distill.teacher=http://127.0.0.1:9/v1", "rollout.temperature=0.7"])
