"""Several nodes on one machine: two `torchrun --nnodes 2` launchers joined by a c10d rendezvous (gloo, CPU, FSDP2)
train, checkpoint and resume as one job with one writer (global rank 0); a worker killed on one node stops both
launchers, and the surviving node's output names the rank that died (vlmrl.trainer.peers)."""

import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from vlmrl.trainer.checkpoint import checkpoint_problem

from .test_judge_faults import free_port
from .test_resume import REWARD, last_train_step, rows, tensorboard_points, worker_pid
from .test_train_e2e import GRPO, SMALL

ROOT = Path(__file__).resolve().parents[1]


def launch_nodes(tmp_path: Path, name: str, *args: str, command: tuple[str, ...] = ("train",)
                 ) -> list[subprocess.Popen]:
    """Two launchers of one 2-node job (one process per node) of `vlmrl COMMAND ARGS`. The first one started hosts
    the rendezvous store (it binds the endpoint); the second starts once the store listens, so which launcher hosts it
    is known."""
    port, run_id = free_port(), f"{name}-{os.getpid()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
               "-m", "vlmrl", *command, *args]
    nodes = []
    for node in (0, 1):
        deadline = time.monotonic() + 60
        while node and not listening(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(tmp_path / f"{name}-node{node}.log", "w") as log:
            nodes.append(subprocess.Popen(launcher, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path))
    return nodes


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def finish(nodes: list[subprocess.Popen], timeout: float) -> tuple[list[int | None], float]:
    """Each launcher's exit code (None: still running at the deadline, then killed with its worker) and the seconds
    until the last one exited."""
    start, codes = time.monotonic(), []
    for node in nodes:
        try:
            codes.append(node.wait(timeout=max(0.0, start + timeout - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for node in nodes:
        if node.poll() is None:
            for pid in filter(None, (worker_pid(node.pid, rank) for rank in (0, 1))):
                os.kill(pid, signal.SIGKILL)
            node.kill()
            node.wait()
    return codes, time.monotonic() - start


def logs(tmp_path: Path, name: str) -> list[str]:
    return [(tmp_path / f"{name}-node{n}.log").read_text() for n in (0, 1)]


def train_args(tmp_path: Path, *extra: str) -> list[str]:
    return [GRPO, *SMALL, "trainer.distributed=fsdp2", f"trainer.output_dir={tmp_path / 'run'}",
            f"rewards=[{{name: '{tmp_path / 'reward.py'}:score', isolate: false}}]", "trainer.lr=1e-2", *extra]


@pytest.mark.slow  # ~30 s (44 s on a busy machine)
def test_two_nodes_train_checkpoint_and_resume_with_one_writer(tmp_path):
    """3 steps on two nodes, a checkpoint (FSDP2: each rank's optimizer shard and RNG in rank 0's folder), then 2 more
    from it on the same two nodes: both launchers exit 0, the run continues at step 4, and every record, event file
    and checkpoint was written once, by global rank 0."""
    (tmp_path / "reward.py").write_text(REWARD)
    codes, _ = finish(launch_nodes(tmp_path, "first", *train_args(tmp_path, "trainer.steps=3")), 300)
    assert codes == [0, 0], "\n".join(x[-3000:] for x in logs(tmp_path, "first"))
    first = tmp_path / "run" / "checkpoint-3"
    assert checkpoint_problem(first) is None
    assert (first / "sharded").is_dir() and (first / "rng-rank1.pt").exists()  # rank 1's parts, in rank 0's folder
    assert torch.load(first / "trainer_state.pt", weights_only=False)["step"] == 3

    resumed = launch_nodes(tmp_path, "resumed", "trainer.steps=5", "--resume", str(tmp_path / "run"))
    codes, _ = finish(resumed, 300)
    out = logs(tmp_path, "resumed")
    assert codes == [0, 0], "\n".join(x[-3000:] for x in out)
    assert sum(x.count("(resumed from checkpoint-3)") for x in out) == 1  # rank 0's progress line only
    assert checkpoint_problem(tmp_path / "run" / "checkpoint-5") is None
    assert torch.load(tmp_path / "run" / "checkpoint-5" / "trainer_state.pt", weights_only=False)["step"] == 5

    # one writer: each record and TensorBoard value once, steps 1-3 then 4-5 in order, one event file per launch, no
    # second run directory
    records = rows(tmp_path / "run")
    assert [k for k, n in Counter((r["phase"], r["step"]) for r in records).items() if n > 1] == []
    assert [r["step"] for r in records if r["phase"] == "train"] == [1, 2, 3, 4, 5]
    points = Counter(tensorboard_points(tmp_path / "run"))
    assert [k for k, n in points.items() if n > 1] == []
    assert sorted(s for tag, s in points if tag == "train/loss") == [1, 2, 3, 4, 5]
    assert len(list((tmp_path / "run" / "tensorboard").rglob("events.out.tfevents.*"))) == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["run"]


@pytest.mark.slow  # ~25 s
def test_a_worker_killed_on_one_node_stops_both_nodes_and_is_named(tmp_path):
    """SIGKILL to the worker on the second node (not its launcher) mid-run: both launchers exit non-zero within
    seconds, and the first node's output names the rank that died. Without vlmrl.trainer.peers the surviving node
    said only gloo's `Connection closed by peer [127.0.0.1]:PORT`."""
    (tmp_path / "reward.py").write_text(REWARD)
    nodes = launch_nodes(tmp_path, "killed", *train_args(tmp_path, "trainer.steps=500"))
    deadline = time.monotonic() + 300
    while last_train_step(tmp_path / "run") < 2 and all(n.poll() is None for n in nodes):
        assert time.monotonic() < deadline, "\n".join(x[-3000:] for x in logs(tmp_path, "killed"))
        time.sleep(0.05)
    rank = next(r for r in (0, 1) if worker_pid(nodes[1].pid, r))  # the rendezvous gives the second node either rank
    os.kill(worker_pid(nodes[1].pid, rank), signal.SIGKILL)
    codes, seconds = finish(nodes, 120)
    survivor, victim = logs(tmp_path, "killed")
    assert None not in codes and 0 not in codes, (codes, survivor[-3000:], victim[-3000:])
    assert seconds < 60  # the survivor waits vlmrl.trainer.peers.PEER_WORD_S (10 s) for a word, then stops
    assert "lost contact with the other ranks" in survivor and f"rank {rank} stopped without a word" in survivor, \
        survivor[-3000:]
    assert "SIGKILL" in victim  # torchrun's own report on the node where it happened


def test_a_rank_that_lost_contact_names_each_peer_by_its_word(monkeypatch):
    """name_stopped against a real TCPStore: a peer's own error is quoted, a silent peer is named as stopped, a peer
    that lost contact too is not blamed; without a store the error says where it was."""
    from vlmrl.trainer import peers

    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    store.set(peers._key(1), "ValueError: data/train.jsonl line 3: no image")
    store.set(peers._key(3), peers.LOST)
    said = peers.name_stopped(0, 4, wait=0.3)
    assert said.split("; ")[0] == "rank 1 failed: ValueError: data/train.jsonl line 3: no image"
    assert said.split("; ")[1].startswith("rank 2 stopped without a word in 0.3 s") and "rank 3" not in said
    assert peers.lost_contact(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.7]:1"))
    assert not peers.lost_contact(ValueError("data/train.jsonl line 3: no image"))
    monkeypatch.setattr(peers, "STORE_CONNECT_S", 0.5)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nobody listens there
    assert "is gone too" in peers.name_stopped(0, 2, wait=0.1)
