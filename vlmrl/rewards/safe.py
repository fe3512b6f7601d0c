"""Safe execution: reward calls under a time limit, in persistent worker processes that are killed when they overrun.

A hanging reward (a sympy simplification that never ends, a user function stuck on a lock) must not hang training.
A thread cannot be stopped and a signal cannot interrupt C code (CPython computing `9**9**9**9` ignores SIGALRM), so
the only hard limit is a separate process that can be killed. `WorkerPool` keeps `size` such processes alive across
steps, so a call costs a pipe round trip (well under a millisecond for a small payload), not a process start:

    pool = WorkerPool(size=2)
    outcomes = pool.run([Job("my_rewards.py:score", (completions,), columns, timeout=30.0)])

A job names its function by reference (`"package.module:function"` or `"/abs/path/file.py:function"`, resolved in the
worker with `resolve_reward`), so nothing but the arguments is pickled. A job that overruns its `timeout` is
reported as timed out, and its worker is killed (with its whole process group) and replaced; a job that raises is
reported with the exception's message. Workers are plain `python -c` subprocesses, not multiprocessing children:
they do not re-import the user's `__main__`, and they cap their own CPU time per job (`RLIMIT_CPU`), so a worker
orphaned by a crashed trainer cannot spin forever.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

_BOOTSTRAP = "import sys; from vlmrl.rewards.safe import worker_main; worker_main(int(sys.argv[1]), int(sys.argv[2]))"


@dataclass
class Job:
    """One call: `resolve_reward(ref)(*args, **kwargs)` in a worker, within `timeout` seconds of wall time."""

    ref: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    timeout: float = 60.0


@dataclass
class Outcome:
    """What came back from a job: `value` when ok, else `error` (and `timed_out` / `fatal` flags)."""

    ok: bool
    value: Any = None
    error: str | None = None
    timed_out: bool = False
    fatal: bool = False  # the function raised FatalRewardError: the caller must stop, not count a failure
    seconds: float = 0.0


def call_maybe_async(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, awaited when it is a coroutine function or returns an awaitable (async user rewards).
    Inside a running event loop (a notebook) the coroutine runs on a helper thread with its own loop."""
    value = fn(*args, **kwargs)
    if not inspect.isawaitable(value):
        return value

    async def _await() -> Any:
        return await value

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_await())
    box: dict[str, Any] = {}

    def runner() -> None:
        try:
            box["value"] = asyncio.run(_await())
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=runner, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _limit_cpu(seconds: float) -> None:
    """Soft RLIMIT_CPU at (CPU used so far + cores * seconds + 5): the kernel ends this process if a job spins past
    it, even when nobody is left to kill it (the parent kills it first, at `seconds` of wall time; CPU time can run
    ahead of wall time by the number of threads). Best effort (not every platform has it)."""
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        soft = int(_cpu_seconds() + (os.cpu_count() or 1) * seconds + 5)
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
    except (ImportError, ValueError, OSError):
        pass


def worker_main(read_fd: int, write_fd: int) -> None:
    """The worker loop: receive (ref, args, kwargs, timeout), send ("ok", value) / ("error", msg) / ("fatal", msg).
    The first message is {"sys_path", "preload"}; the worker answers ("ready", pid) once its imports are done."""
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    init = inbox.recv()
    sys.path[:] = init["sys_path"]
    import importlib

    from vlmrl.errors import FatalRewardError
    from vlmrl.references import resolve_reference

    def resolve_reward(ref: str) -> Any:  # jobs name functions as "module:function" or "/abs/file.py:function"
        return resolve_reference(ref, "reward", {})

    for entry in init["preload"]:  # "module" is imported; "module:function" is called (a warm-up)
        if ":" in entry:
            resolve_reward(entry)()
        else:
            importlib.import_module(entry)

    outbox.send(("ready", os.getpid()))
    while True:
        try:
            ref, args, kwargs, timeout = inbox.recv()
        except (EOFError, OSError):
            return
        _limit_cpu(timeout)
        try:
            message: tuple[str, Any] = ("ok", call_maybe_async(resolve_reward(ref), *args, **kwargs))
        except FatalRewardError as exc:
            message = ("fatal", str(exc))
        except BaseException as exc:  # reported to the parent as this job's failure; the worker lives on
            message = ("error", f"{type(exc).__name__}: {exc}")
        try:
            outbox.send(message)
        except Exception as exc:  # an unpicklable return value
            outbox.send(("error", f"the result could not be sent back from the worker: {type(exc).__name__}: {exc}"))


class _Worker:
    """One worker subprocess and its two pipe ends."""

    def __init__(self, preload: tuple[str, ...], start_timeout: float):
        parent_read, child_write = os.pipe()
        child_read, parent_write = os.pipe()
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, str(child_read), str(child_write)],
            pass_fds=(child_read, child_write), stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )
        os.close(child_read)
        os.close(child_write)
        self.inbox = Connection(parent_read, writable=False)
        self.outbox = Connection(parent_write, readable=False)
        self.outbox.send({"sys_path": list(sys.path), "preload": list(preload)})
        if not self.inbox.poll(start_timeout):
            self.kill()
            raise RuntimeError(f"a reward worker did not start within {start_timeout:.0f} s")
        try:
            status, _ = self.inbox.recv()
        except EOFError:
            self.kill()
            raise RuntimeError(f"a reward worker exited at start (code {self.proc.wait()}); run "
                               f"`{sys.executable} -c 'import vlmrl.rewards'` to see why") from None
        assert status == "ready"

    def kill(self) -> None:
        """Kill the worker and its process group (children a user reward started), then reap it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        self.proc.wait()
        for conn in (self.inbox, self.outbox):
            conn.close()


class WorkerPool:
    """`size` persistent worker processes; `run(jobs)` spreads jobs over them, each within its own time limit.

    A worker is started on first use and again after it is killed (timeout) or dies (crash, CPU limit). `preload`
    lists modules every worker imports ("module") or functions it calls ("module:function") before it counts as
    started, so a job's time limit never pays for imports or warm-up."""

    def __init__(self, size: int = 2, preload: tuple[str, ...] = (), start_timeout: float = 120.0):
        if size < 1:
            raise ValueError(f"WorkerPool size must be >= 1, got {size}")
        self.size, self.preload, self.start_timeout = size, tuple(preload), start_timeout
        self._workers: list[_Worker | None] = [None] * size
        self._lock = threading.Lock()
        self.restarts = 0  # workers replaced after a timeout or a crash

    def _worker(self, slot: int) -> _Worker:
        worker = self._workers[slot]
        if worker is None or worker.proc.poll() is not None:
            if worker is not None:
                worker.kill()
                self.restarts += 1
            worker = self._workers[slot] = _Worker(self.preload, self.start_timeout)
        return worker

    def _discard(self, slot: int) -> None:
        worker = self._workers[slot]
        if worker is not None:
            worker.kill()
            self._workers[slot] = None
            self.restarts += 1

    def run(self, jobs: list[Job], deadline: float | None = None) -> list[Outcome]:
        """Outcomes of `jobs`, in order. `deadline` (a `time.monotonic()` value) bounds the whole batch: a job not
        started by then fails without running, and a running job is cut at min(its own limit, the deadline)."""
        with self._lock:
            return self._run(jobs, deadline)

    def _run(self, jobs: list[Job], deadline: float | None) -> list[Outcome]:
        running: dict[int, tuple[int, float, float]] = {}  # slot -> (job index, start, cut-off)
        try:
            return self._loop(jobs, deadline, running)
        except BaseException:  # e.g. KeyboardInterrupt: a worker still busy would answer the next job with this one's
            for slot in running:
                self._discard(slot)
            raise

    def _loop(self, jobs: list[Job], deadline: float | None,
              running: dict[int, tuple[int, float, float]]) -> list[Outcome]:
        results: list[Outcome | None] = [None] * len(jobs)
        pending = deque(range(len(jobs)))
        while pending or running:
            for slot in range(self.size):
                if slot in running or not pending:
                    continue
                index = pending.popleft()
                job, now = jobs[index], time.monotonic()
                if deadline is not None and now >= deadline:
                    results[index] = Outcome(False, error="not run: the batch's time budget was spent")
                    continue
                worker = self._worker(slot)
                start = time.monotonic()
                cutoff = start + job.timeout if deadline is None else min(start + job.timeout, deadline)
                try:
                    worker.outbox.send((job.ref, job.args, job.kwargs, job.timeout))
                except Exception as exc:  # unpicklable arguments
                    results[index] = Outcome(False, error=f"arguments could not be sent to the worker: {exc}")
                    continue
                running[slot] = (index, start, cutoff)
            if not running:
                continue
            readers = {self._workers[slot].inbox: slot for slot in running}  # type: ignore[union-attr]
            wait_for = max(0.0, min(cut for _, _, cut in running.values()) - time.monotonic())
            for conn in wait(list(readers), timeout=wait_for):
                slot = readers[conn]  # type: ignore[index]
                index, start, _ = running.pop(slot)
                results[index] = self._receive(slot, time.monotonic() - start)
            now = time.monotonic()
            for slot, (index, start, cutoff) in list(running.items()):
                if now >= cutoff:
                    del running[slot]
                    self._discard(slot)
                    limit = cutoff - start
                    results[index] = Outcome(False, error=f"timed out after {limit:.3g} s (worker killed)",
                                             timed_out=True, seconds=now - start)
        return [r if r is not None else Outcome(False, error="lost") for r in results]

    def _receive(self, slot: int, seconds: float) -> Outcome:
        worker = self._workers[slot]
        try:
            status, payload = worker.inbox.recv()  # type: ignore[union-attr]
        except (EOFError, OSError):
            code = worker.proc.wait() if worker else None  # type: ignore[union-attr]
            self._discard(slot)
            return Outcome(False, error=f"the worker died (exit code {code}; a CPU or memory limit?)", seconds=seconds)
        if status == "ok":
            return Outcome(True, value=payload, seconds=seconds)
        return Outcome(False, error=payload, fatal=status == "fatal", seconds=seconds)

    def close(self) -> None:
        """Stop every worker (they are also stopped at interpreter exit)."""
        for slot, worker in enumerate(self._workers):
            if worker is not None:
                worker.kill()
                self._workers[slot] = None


_POOLS: dict[str, WorkerPool] = {}
_POOLS_LOCK = threading.Lock()


def get_pool(name: str, size: int | None = None, preload: tuple[str, ...] = ()) -> WorkerPool:
    """The process-wide pool `name` ("rewards", "math"), created on first use and kept for the process's life."""
    with _POOLS_LOCK:
        pool = _POOLS.get(name)
        if pool is None:
            size = size or max(1, min(2, os.cpu_count() or 1))
            pool = _POOLS[name] = WorkerPool(size, preload)
        return pool


@atexit.register
def close_pools() -> None:
    """Stop every pool's workers."""
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()
