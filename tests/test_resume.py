"""Preemption-safe checkpoints and exact resume, through real `vlmrl train` processes: killed with SIGKILL at a
random step, killed while a checkpoint is being written, stopped with SIGTERM, each time followed by `vlmrl train
--resume RUN_DIR`. Every run must end with the uninterrupted run's weights, bit for bit, and log each (phase, step)
once in metrics.jsonl, rollouts.jsonl and TensorBoard.

Each process pays ~15-25 CPU-seconds of imports, so the interruptions are chained: two runs (random steps from seeds
1 and 2), each killed with SIGKILL, resumed and interrupted again (killed mid-save; stopped by SIGTERM), then resumed
to the end. The two chains run side by side; the uninterrupted reference runs in this process.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from vlmrl.config import load_config
from vlmrl.trainer.checkpoint import KILL_IN_SAVE, checkpoint_problem
from vlmrl.trainer.resume import find_resume_point

from .test_train_e2e import GRPO, SMALL

STEPS = 8
# 6 prompts, 2 per step: the prompt stream starts a new shuffled pass (epoch) at steps 4 and 7
ARGS = [*SMALL, "data.train.n=6", "data.sft.n=8", "data.eval.n=4", f"trainer.steps={STEPS}", "trainer.eval_every=3",
        "trainer.log_rollouts_every=1", "trainer.lr=1e-2", "rollout.prompts_per_step=2"]
# answers of different lengths score differently even for an untrained model, so every step moves the weights
REWARD = "def score(completions, **columns):\n    return [float(len(c) % 3) for c in completions]\n"


def train_args(root: Path, name: str, *extra: str) -> list[str]:
    return [*ARGS, f"trainer.output_dir={root / name}", f"rewards=[{{name: '{root / 'reward.py'}:score', "
            "isolate: false}]", *extra]


def rows(run_dir: Path, name: str = "metrics.jsonl", strict: bool = True) -> list[dict]:
    """The file's records; `strict=False` skips a line that is not JSON (being written, or cut by a kill)."""
    path, out = run_dir / name, []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            if strict:
                raise
    return out


def last_train_step(run_dir: Path) -> int:
    return max((r["step"] for r in rows(run_dir, strict=False) if r["phase"] == "train"), default=0)


def weights(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(checkpoint / "model.safetensors")


def tensorboard_points(run_dir: Path) -> list[tuple[str, int]]:
    """Every (tag, step) value in the run's event files, as written (duplicates included)."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    out = []
    for file in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        for raw in RawEventFileLoader(str(file)).Load():
            event = Event.FromString(raw)
            out += [(v.tag, event.step) for v in event.summary.value]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (checkpoints only at the start and the end), in this process."""
    from vlmrl.trainer.run import train

    root = tmp_path_factory.mktemp("resume")
    (root / "reward.py").write_text(REWARD)
    train(load_config(None, train_args(root, "reference")))
    return root, weights(root / "reference" / f"checkpoint-{STEPS}"), rows(root / "reference")


class Stage:
    """One `vlmrl train` process of a chain and how it is interrupted: "kill" (SIGKILL) or "term" (SIGTERM) once a
    train row at step >= `at` appears, "save" (it SIGKILLs itself writing its first scheduled checkpoint), or None."""

    def __init__(self, how: str | None, at: int = 0):
        self.how, self.at, self.proc, self.result = how, at, None, {}


def run_chain_stage(root: Path, name: str, stage: Stage, first: bool) -> None:
    run_dir, env = root / name, {**os.environ, "OMP_NUM_THREADS": "1"}
    if first:
        cmd = [GRPO, *train_args(root, name, "trainer.save_every=2")]  # (the CLI without a recipe: the quickstart)
    else:
        point = find_resume_point(run_dir)
        stage.result["resumed_from"] = point.step
        cmd = ["--resume", str(run_dir)]
        if stage.how == "save":
            env[KILL_IN_SAVE] = str(point.step + 2 - point.step % 2)  # its first scheduled save (save_every=2)
        stage.at = max(stage.at, last_train_step(run_dir) + 1)  # a step this process logs (the old rows are older)
    log = root / f"{name}-{len([p for p in root.glob(f'{name}-*.err')])}"
    stage.result["log"] = log
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        stage.proc = subprocess.Popen([sys.executable, "-m", "vlmrl", "train", *cmd], env=env, stdout=out, stderr=err)


@pytest.fixture(scope="module")
def chains(reference):
    root = reference[0]
    plans = {}
    for seed, second in ((1, "save"), (2, "term")):
        rng = random.Random(seed)
        plans[f"seed{seed}"] = [Stage("kill", rng.randint(2, STEPS - 3)), Stage(second, rng.randint(4, STEPS - 2)),
                                Stage(None)]
    position = dict.fromkeys(plans, 0)
    for name in plans:
        run_chain_stage(root, name, plans[name][0], first=True)
    deadline = time.monotonic() + 900
    while any(position[n] < len(plans[n]) for n in plans) and time.monotonic() < deadline:
        for name, stages in plans.items():
            if position[name] == len(stages):
                continue
            stage = stages[position[name]]
            if stage.how in ("kill", "term") and stage.proc.poll() is None and "signalled" not in stage.result \
                    and last_train_step(root / name) >= stage.at:
                stage.proc.send_signal(signal.SIGKILL if stage.how == "kill" else signal.SIGTERM)
                stage.result["signalled"] = last_train_step(root / name)
            if stage.proc.poll() is not None:
                log = stage.result["log"]
                stage.result.update(code=stage.proc.returncode, out=Path(f"{log}.out").read_text(),
                                    err=Path(f"{log}.err").read_text(), rows=rows(root / name, strict=False),
                                    left={p.name for p in (root / name).iterdir()})
                position[name] += 1
                if position[name] < len(stages):
                    run_chain_stage(root, name, stages[position[name]], first=False)
        time.sleep(0.01)
    for stage in (s for stages in plans.values() for s in stages):
        if stage.proc is not None and stage.proc.poll() is None:
            stage.proc.kill()
    assert all(position[n] == len(plans[n]) for n in plans), "the chains did not finish in time"
    return plans


def assert_continues_reference(reference, run_dir: Path) -> None:
    """The final weights are the reference's, bit for bit, and so is every row logged; each step is logged once."""
    _, reference_weights, reference_rows = reference
    final = weights(run_dir / f"checkpoint-{STEPS}")
    assert final.keys() == reference_weights.keys()
    for k, v in reference_weights.items():
        assert torch.equal(v, final[k]), (run_dir.name, k, (v - final[k]).abs().max().item())
    records = rows(run_dir)
    # the resumed rows are the reference's rows (timings aside)
    expected = {(r["phase"], r["step"]): r for r in reference_rows}
    for r in records:
        for key in ("loss", "reward/total/mean", "greedy/accuracy", "greedy/mean_length"):
            if key in r:
                assert r[key] == expected[r["phase"], r["step"]][key], (r["phase"], r["step"], key)
    assert_logged_once(run_dir)


def assert_logged_once(run_dir: Path) -> None:
    """metrics.jsonl, rollouts.jsonl and the TensorBoard events hold each (phase or tag, step) of the run once."""
    records = rows(run_dir)
    counts = Counter((r["phase"], r["step"]) for r in records)
    assert [key for key, n in counts.items() if n > 1] == []
    assert sorted(s for p, s in counts if p == "train") == list(range(1, STEPS + 1))
    assert sorted(s for p, s in counts if p == "eval") == [0, 3, 6, STEPS]
    assert sorted(s for p, s in counts if p == "sft") == [1, 2] and ("data", 0) in counts
    assert sorted(e["step"] for e in rows(run_dir, "rollouts.jsonl")) == list(range(1, STEPS + 1))
    points = Counter(tensorboard_points(run_dir))
    assert [key for key, n in points.items() if n > 1] == []
    assert sorted(s for tag, s in points if tag == "train/loss") == list(range(1, STEPS + 1))
    assert sorted(s for tag, s in points if tag == "sft/loss") == [1, 2]  # the SFT axis is not rewound
    assert sorted(s for tag, s in points if tag == "eval/greedy/accuracy") == [0, 3, 6, STEPS]


def test_reference_run_trains(reference):
    """The comparisons below mean something: the reference's RL steps moved the weights."""
    root, final, _ = reference
    start_weights = weights(root / "reference" / "checkpoint-0")
    assert max((final[k] - start_weights[k]).abs().max().item() for k in start_weights) > 1e-3


@pytest.mark.parametrize("name", ["seed1", "seed2"])
def test_sigkill_at_a_random_step_then_resume_is_exact(reference, chains, name):
    killed = chains[name][0].result
    assert killed["code"] == -signal.SIGKILL, killed["err"][-3000:]
    assert max(r["step"] for r in killed["rows"] if r["phase"] == "train") < STEPS  # it died mid-run
    assert f"checkpoint-{STEPS}" not in killed["left"]
    last = chains[name][-1].result
    assert last["code"] == 0, last["err"][-3000:]
    assert_continues_reference(reference, reference[0] / name)


def test_kill_during_a_save_resumes_from_the_previous_complete_checkpoint(chains):
    died = chains["seed1"][1].result
    assert died["code"] == -signal.SIGKILL, died["err"][-3000:]
    saving = died["resumed_from"] + 2 - died["resumed_from"] % 2
    assert f"checkpoint-{saving}.partial" in died["left"] and f"checkpoint-{saving}" not in died["left"]
    err = chains["seed1"][2].result["err"]
    assert f"skipped checkpoint-{saving}.partial" in err and f"resuming from checkpoint-{died['resumed_from']}" in err
    assert chains["seed1"][2].result["resumed_from"] == died["resumed_from"]


def test_sigterm_stops_with_a_checkpoint_exit_0_and_resumes_exactly(chains):
    stopped = chains["seed2"][1].result
    assert stopped["code"] == 0, stopped["err"][-3000:]
    step = int(stopped["out"].split("stopped after step ")[1].split(";")[0])
    assert stopped["signalled"] <= step < STEPS and "SIGTERM" in stopped["out"]
    assert f"resume with: vlmrl train --resume {stopped['log'].parent / 'seed2'}" in stopped["out"]
    assert f"checkpoint-{step}" in stopped["left"] and f"checkpoint-{STEPS}" not in stopped["left"]
    assert checkpoint_problem(stopped["log"].parent / "seed2" / f"checkpoint-{step}") is None
    assert chains["seed2"][2].result["resumed_from"] == step


def test_resume_across_a_data_epoch_is_exact(reference, tmp_path):
    """Resumed at step 2, the run crosses the prompt stream's epoch boundary at step 4, where the new shuffle comes
    from the restored generator: without the RNG and data-order state it draws other prompts."""
    from vlmrl.trainer.run import train

    (tmp_path / "reward.py").write_text(REWARD)
    train(load_config(None, train_args(tmp_path, "run", "trainer.save_every=2", "trainer.steps=3")))
    run_dir = tmp_path / "run"
    state = torch.load(run_dir / "checkpoint-2" / "trainer_state.pt", weights_only=False)
    assert state["data"]["epoch"] == 0 and state["data"]["pos"] == 4
    # extended to the reference's 8 steps on resume (trainer.steps may change: the schedule is constant)
    summary = train(load_config(None, train_args(tmp_path, "run", "trainer.save_every=2")),
                    resume=run_dir / "checkpoint-2")
    assert torch.load(Path(summary["checkpoint"]) / "trainer_state.pt", weights_only=False)["data"]["epoch"] == 2
    assert not (run_dir / "checkpoint-3").exists()  # past the resume point: removed, the run continues from 2
    assert_continues_reference(reference, run_dir)


def test_a_stop_at_an_evaluation_step_leaves_that_evaluation_to_the_resumed_run(reference, tmp_path, monkeypatch):
    """SIGTERM during step 3, whose evaluation is due: the run checkpoints without evaluating (a preemption's grace
    period is short); the resumed run evaluates step 3 first, then goes on as if never stopped."""
    from vlmrl.trainer import run

    step = run.RLJob.step

    def step_then_signal(job, n):
        out = step(job, n)
        if n == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # caught by train()'s handler: stop after this step
        return out

    (tmp_path / "reward.py").write_text(REWARD)
    monkeypatch.setattr(run.RLJob, "step", step_then_signal)
    summary = run.train(load_config(None, train_args(tmp_path, "run")))
    assert summary["preempted"] == "SIGTERM" and summary["stopped_at"] == 3 and "final" not in summary
    state = torch.load(tmp_path / "run" / "checkpoint-3" / "trainer_state.pt", weights_only=False)
    assert state["eval_pending"] and ("eval", 3) not in {(r["phase"], r["step"]) for r in rows(tmp_path / "run")}
    monkeypatch.setattr(run.RLJob, "step", step)
    run.train(load_config(None, train_args(tmp_path, "run")), resume=tmp_path / "run")
    assert_continues_reference(reference, tmp_path / "run")


def worker_pid(parent: int, rank: int) -> int | None:
    """The pid of torchrun's worker process with RANK=`rank` (read from /proc)."""
    children = Path(f"/proc/{parent}/task/{parent}/children")
    for pid in (children.read_text().split() if children.exists() else []):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return int(pid)
    return None


@pytest.mark.slow
def test_sigterm_to_one_torchrun_rank_stops_every_rank_after_the_same_step(tmp_path):
    """Under torchrun (DDP, 2 processes) SIGTERM reaches one rank only: all ranks agree to stop after the same step,
    write one checkpoint together and exit 0; the resumed run ends where an uninterrupted one does."""
    (tmp_path / "reward.py").write_text(REWARD)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "vlmrl",
                "train"]

    def launch(log: str, *extra: str) -> subprocess.Popen:
        with open(tmp_path / log, "w") as f:
            return subprocess.Popen([*torchrun, *extra], env=env, stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path)

    def finish(proc: subprocess.Popen, log: str) -> tuple[int, str]:
        try:
            proc.wait(timeout=600)
        except subprocess.TimeoutExpired:  # ranks that disagree wait for each other's collectives
            for pid in filter(None, (worker_pid(proc.pid, rank) for rank in (0, 1))):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
        return proc.wait(), (tmp_path / log).read_text()

    whole = launch("whole.log", GRPO, *train_args(tmp_path, "whole", "trainer.distributed=ddp"))
    stopped = launch("stopped.log", GRPO, *train_args(tmp_path, "stopped", "trainer.distributed=ddp"))
    signalled, deadline = None, time.monotonic() + 600
    while stopped.poll() is None and time.monotonic() < deadline:
        if signalled is None and last_train_step(tmp_path / "stopped") >= 3:
            signalled = worker_pid(stopped.pid, 1)
            os.kill(signalled, signal.SIGTERM)
        time.sleep(0.01)
    code, out = finish(stopped, "stopped.log")
    assert signalled and code == 0, out[-3000:]
    steps = {int(x.split(";")[0]) for x in out.split("stopped after step ")[1:]}
    assert len(steps) == 1 and out.count("stopped after step ") == 2, out[-3000:]  # both ranks, the same step
    (step,) = steps
    assert checkpoint_problem(tmp_path / "stopped" / f"checkpoint-{step}") is None
    assert (tmp_path / "stopped" / f"checkpoint-{step}" / "rng-rank1.pt").exists()
    code, out = finish(launch("resumed.log", "--resume", str(tmp_path / "stopped")), "resumed.log")
    assert code == 0, out[-3000:]
    code, out = finish(whole, "whole.log")
    assert code == 0, out[-3000:]
    a, b = (weights(tmp_path / name / f"checkpoint-{STEPS}") for name in ("whole", "stopped"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert_logged_once(tmp_path / "stopped")
