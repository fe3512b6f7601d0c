"""The pieces of preemption-safe checkpoints and resume, without a model: which checkpoint a resume takes, rotation,
the save schedule, what a rewind keeps, which overrides keep a resumed run exact, and the CUDA RNG states.
tests/test_resume.py runs them together in real `vlmrl train` processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vlmrl.config import load_config, save_config
from vlmrl.errors import ConfigError, PathError
from vlmrl.trainer.checkpoint import MARKER, checkpoint_problem, restore_rng, rng_state, rotate_checkpoints
from vlmrl.trainer.logger import kept_after_rewind
from vlmrl.trainer.preempt import SaveClock
from vlmrl.trainer.resume import ResumePoint, check_resume, find_resume_point


def fake_checkpoint(run_dir: Path, step: int, complete: bool = True) -> Path:
    path = run_dir / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.pt").write_bytes(b"x" * 10)
    if complete:
        (path / MARKER).write_text(json.dumps({"step": step, "files": {"trainer_state.pt": 10}}))
    return path


def test_resume_point_is_the_newest_complete_checkpoint(tmp_path):
    for step in (0, 2):
        fake_checkpoint(tmp_path, step)
    fake_checkpoint(tmp_path, 4, complete=False)  # a folder that never got its marker
    (tmp_path / "checkpoint-6.partial").mkdir()  # an interrupted save
    point = find_resume_point(tmp_path)
    assert point.checkpoint.name == "checkpoint-2" and point.step == 2
    assert any("checkpoint-4" in n for n in point.notes) and any("checkpoint-6.partial" in n for n in point.notes)
    with pytest.raises(PathError, match="newest complete one is .*checkpoint-2"):
        find_resume_point(tmp_path / "checkpoint-4")  # an explicit incomplete checkpoint is refused
    (tmp_path / "checkpoint-2" / "trainer_state.pt").write_bytes(b"x" * 3)  # damaged after its save
    assert "3 bytes, 10 when it was saved" in checkpoint_problem(tmp_path / "checkpoint-2")
    assert find_resume_point(tmp_path).checkpoint.name == "checkpoint-0"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text("{}")
    with pytest.raises(PathError, match="no complete checkpoint"):
        find_resume_point(empty)


def test_rotation_keeps_the_start_the_final_and_the_newest(tmp_path):
    for step in (0, 2, 4, 6, 8, 10):
        fake_checkpoint(tmp_path, step)
    rotate_checkpoints(tmp_path, keep=2, newest=8, final=10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-0", "checkpoint-10", "checkpoint-6",
                                                          "checkpoint-8"]
    rotate_checkpoints(tmp_path, keep=0, newest=8, final=10)  # 0 keeps all
    assert len(list(tmp_path.iterdir())) == 4


def test_save_schedule_by_steps_and_by_wall_clock():
    now = [0.0]
    t = load_config(None, ["trainer.steps=10", "trainer.save_every=4", "trainer.save_every_minutes=1"]).trainer
    clock = SaveClock(t, clock=lambda: now[0])
    assert [s for s in range(1, 11) if clock.due(s)] == [4, 8]  # the end (10) writes its own
    now[0] = 61.0
    assert clock.due(5)
    clock.saved()
    assert not clock.due(5)


def test_rewind_keeps_other_axes_and_drops_what_will_be_logged_again():
    assert kept_after_rewind("sft", 50, to=4, rerun_eval=False)  # SFT steps are not RL steps
    assert kept_after_rewind("train", 4, to=4, rerun_eval=True) and not kept_after_rewind("train", 5, 4, False)
    assert kept_after_rewind("eval", 4, to=4, rerun_eval=False) and not kept_after_rewind("eval", 4, 4, True)
    assert not kept_after_rewind("summary", 2, to=4, rerun_eval=False)


def test_overrides_on_resume_are_named_or_refused(tmp_path):
    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    save_config(load_config(None, ["trainer.steps=8"]), ckpt / "config.yaml")
    point = ResumePoint(tmp_path, ckpt, 4)
    state = {"optimizer": {"state": {0: {}}}, "sharded_optimizer": False, "optimizer_empty": False}
    same = check_resume(load_config(None, ["trainer.steps=12", "trainer.eval_every=5", "trainer.threads=2"]), point,
                        state, sharded_now=False)
    assert same == []  # scheduling, logging and threads keep the run exact
    notes = check_resume(load_config(None, ["trainer.steps=8", "trainer.lr=1e-5", "data.train.n=10"]), point,
                         state, sharded_now=False)
    assert len(notes) == 2 and "trainer.lr changed" in notes[1] and "data.train changed" in notes[0]
    cosine = check_resume(load_config(None, ["trainer.steps=12", "trainer.lr_schedule=cosine"]), point, state,
                          sharded_now=False)
    assert any("schedule is stretched" in n for n in cosine)
    with pytest.raises(ConfigError, match="sharded"):
        check_resume(load_config(None, ["trainer.steps=8"]), point, state, sharded_now=True)
    with pytest.raises(ConfigError, match="trainer.steps=3"):
        check_resume(load_config(None, ["trainer.steps=3"]), point, state, sharded_now=False)


def test_cuda_rng_states_travel_with_the_checkpoint(monkeypatch):
    """The CUDA part of the RNG state, with torch.cuda faked (the test below checks it on a real GPU)."""
    devices = {0: torch.tensor([1], dtype=torch.uint8), 1: torch.tensor([2], dtype=torch.uint8)}
    restored = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [devices[0].clone(), devices[1].clone()])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.__setitem__(device, state))
    state = rng_state()
    devices[0].fill_(9)
    restore_rng(state)
    assert {k: v.tolist() for k, v in restored.items()} == {0: [1], 1: [2]}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rng_states_are_saved_and_restored():
    torch.cuda.init()
    state = rng_state()
    expected = torch.rand(4, device="cuda")
    torch.rand(100, device="cuda")
    restore_rng(state)
    assert torch.equal(torch.rand(4, device="cuda"), expected)
