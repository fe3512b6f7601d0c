"""Preemption: SIGTERM or SIGINT asks the run to stop at the next step boundary, with a checkpoint; a second signal
ends the process at once. Every rank of a torchrun job agrees on the stop (and on time-based saves) through one
all-reduce per step (one more after an evaluation or a checkpoint, for a signal that came during it), so all of
them stop after the same step and join the same checkpoint."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from vlmrl.config import TrainerConfig
from vlmrl.trainer.distributed import DistInfo, rank_max

SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW = 1.0  # seconds: a signal this soon after the first is the same request, not a second one


class StopRequest:
    """While active (`with StopRequest(...) as stop:`), the first SIGTERM/SIGINT sets `stop.signum` (its number)
    and calls `on_signal`; a second one (more than REPEAT_WINDOW later) restores the default action and re-sends itself:
    the process ends at once.
    Outside the main thread (signals cannot be caught there) it installs nothing and never requests a stop."""

    def __init__(self, on_signal: Callable[[str], None] = lambda text: None):
        self.on_signal, self.signum, self._previous, self._first = on_signal, 0, {}, 0.0

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signum:
            if time.monotonic() - self._first < REPEAT_WINDOW:
                return  # one preemption delivered twice (by the scheduler, and forwarded by torchrun)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum, self._first = signum, time.monotonic()
        try:
            self.on_signal(f"{signal.Signals(signum).name}: finishing this step, then writing a checkpoint and "
                           "stopping (send it again to stop at once, without a checkpoint)")
        except RuntimeError:  # the signal came in the middle of a write to the same stream (a progress bar's)
            pass


class SaveClock:
    """When to write a checkpoint between the start and the end: every `trainer.save_every` steps, and once
    `trainer.save_every_minutes` passed since the last one (the most work a kill -9 or a power loss can cost)."""

    def __init__(self, trainer: TrainerConfig, clock: Callable[[], float] = time.monotonic):
        self.trainer, self.clock = trainer, clock
        self.last = clock()

    def due(self, step: int) -> bool:
        t = self.trainer
        by_step = bool(t.save_every) and step % t.save_every == 0
        by_time = t.save_every_minutes > 0 and self.clock() - self.last >= 60 * t.save_every_minutes
        return step != t.steps and (by_step or by_time)  # the end writes its own

    def saved(self) -> None:
        self.last = self.clock()


def step_decisions(stop: StopRequest, clock: SaveClock, step: int, dist: DistInfo) -> tuple[int, bool]:
    """(stop now: the signal number or 0, save now) after `step`, the same on every rank: any rank's signal stops
    all of them; the save schedule is rank 0's (its clock), so time-based saves cannot split the ranks."""
    signum, saving = rank_max([stop.signum, dist.is_main and clock.due(step)], dist)
    stop.signum = stop.signum or signum  # the signal another rank received, for this rank's summary
    return signum, bool(saving)


def agreed_stop(stop: StopRequest, dist: DistInfo) -> int:
    """Whether any rank received a signal since the last decision (its number, or 0), agreed by all ranks."""
    signum = rank_max([stop.signum], dist)[0]
    stop.signum = stop.signum or signum
    return signum
