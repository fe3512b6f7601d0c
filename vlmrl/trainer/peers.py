"""Which rank stopped: a rank whose collective fails because a peer went away names that peer.

Under torchrun, on one node or several, a process that dies makes the other ranks' next collective fail with the
transport's words only (gloo: `Read error [10.0.0.7]:40312: Connection reset by peer`), which name no rank; torchrun
then stops every node, and only the dead rank's own node says which rank it was. So every rank leaves a word in
torchrun's rendezvous store as it leaves `train` with an error:

- a rank that fails on its own (a bug, a data or reward error) writes its error and stops at once;
- a rank whose collective failed (`lost_contact`) writes "lost contact", waits up to `PEER_WORD_S` seconds for every
  other rank's word and raises a TrainingError naming each rank that failed (with its error) or left no word (killed:
  SIGKILL, out of memory, its node went down, or it hangs).

The store is the one torchrun's agents host at the rendezvous endpoint (MASTER_ADDR:MASTER_PORT in each worker). If
the rank that died ran on that host, its launcher exits with it and takes the store along: the error then says so.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time

import torch.distributed as dist

# how long a rank that lost contact waits for the other ranks' word before naming the silent ones, and tries to reach
# the rendezvous store (vlmrl.deadlines)
from vlmrl.deadlines import PEER_WORD_S, STORE_CONNECT_S
from vlmrl.errors import TrainingError

LOST = "lost contact"
# what gloo and NCCL say when a peer's connection is gone (gloo raises a plain RuntimeError)
TRANSPORT_WORDS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "gloo/transport")


def lost_contact(exc: BaseException) -> bool:
    """Whether `exc` is a communication failure (a peer went away or timed out), not this rank's own error."""
    return isinstance(exc, dist.DistError) or any(w in str(exc) for w in TRANSPORT_WORDS)


@contextlib.contextmanager
def peers_named():
    """Around a run under torchrun: an error leaves this rank's word in the store; a lost peer is named (module
    docstring). Outside torchrun, or before the process group exists, errors pass through untouched."""
    try:
        yield
    except Exception as exc:
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            raise
        rank, world = dist.get_rank(), dist.get_world_size()
        if not lost_contact(exc):
            with contextlib.suppress(Exception):  # the word is a courtesy to the other ranks; the error is the point
                _store().set(_key(rank), f"{type(exc).__name__}: {exc}"[:500])
            raise
        raise TrainingError(f"rank {rank} lost contact with the other ranks ({first_line(exc)}): "
                            f"{name_stopped(rank, world)}") from exc


def name_stopped(rank: int, world: int, wait: float = PEER_WORD_S) -> str:
    """Leave this rank's "lost contact" and say which other ranks failed (their error) or left no word in `wait` s."""
    try:
        store = _store()
        store.set(_key(rank), LOST)
        others = [r for r in range(world) if r != rank]
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not store.check([_key(r) for r in others]):
            time.sleep(0.1)
        words = {r: store.get(_key(r)).decode() if store.check([_key(r)]) else None for r in others}
    except Exception as exc:  # the store's host is gone
        return (f"the rendezvous store at {_address()} is gone too ({first_line(exc)}): the launcher that hosts it "
                f"has exited, so the rank that stopped most likely ran on that host; its log says which")
    named = [f"rank {r} failed: {w}" if w is not None else
             f"rank {r} stopped without a word in {wait:g} s (killed: SIGKILL, out of memory, its node went down; or "
             f"it hangs): its node's log says more" for r, w in words.items() if w != LOST]
    return "; ".join(named) or "every other rank lost contact too (a network failure?)"


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__


def _address() -> str:
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def _key(rank: int) -> str:
    # one namespace per torchrun run and restart attempt, beside torch's own keys
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return f"vlmrl/peers/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


def _store():
    """A client of the store torchrun's agents host (each worker's MASTER_ADDR:MASTER_PORT)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=STORE_CONNECT_S), wait_for_workers=False)
