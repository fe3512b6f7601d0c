"""Environment steps off the decoding loop: a trajectory's tools run as soon as its turn ends, beside the others.

A turn's environment steps (the tool calls: a zoom, a search, a code run, a call to a remote service) used to run one
after another once every live trajectory had finished decoding, so a step of N trajectories waited N tool latencies
after the slowest turn. With `workers` > 1 (`agent.env_workers`, default 8) each trajectory's step starts on a worker
thread the moment its turn ends with an end token, found by `generate`'s `on_token` while the other rows still decode;
steps run beside each other, up to `workers` at once. With vLLM (whose call returns every row at once) the steps start
together after the call. Nothing else moves off the rollout's thread: each step's result is taken in trajectory
order, and the observation is rendered (template, image preprocessing) there, in that order, so the trajectories are
the ones the sequential loop gives, token for token, whenever the environments are deterministic and independent of
each other (each trajectory has its own environment and `ToolContext`).

`workers` = 1 is the sequential loop: every step on the rollout's thread after the turn, in trajectory order (for
environments or tools that share state and are not thread-safe, or that draw from a shared random stream).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from vlmrl.agent.env import Observation
from vlmrl.rollout.generate import OnToken, Rollout


def step_env(env, text: str) -> tuple[Observation, str | None]:
    """The environment's answer to `text`; a user environment that raises ends its episode (the error text comes
    back, the rollout counts it), never the run."""
    try:
        return env.step(text), None
    except Exception as exc:
        return Observation(done=True), f"{type(exc).__name__}: {exc}"


class EnvSteps:
    """One rollout's environment steps, turn by turn: `begin(envs)` names the live trajectories' environments (row j
    of the turn's generation call is `envs[j]`), `watch(on_token)` is the `on_token` for `generate` that starts a row's
    step when it samples an end token, `start_rest(out)` starts the rows a call returned ended without being watched
    (vLLM), and `result(j, text)` gives row j's (observation, error) — computed now when it was not started."""

    def __init__(self, workers: int, tokenizer, eos_token_ids: list[int]):
        self.workers, self.tokenizer = int(workers), tokenizer
        self.eos = torch.tensor(list(eos_token_ids))
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="vlmrl-env") if self.workers > 1 else None
        self.envs: list = []
        self.started: dict[int, Future] = {}  # row -> its step: (text it was given, observation, error)
        self.steps: list[torch.Tensor] = []  # the call's sampled tokens, one [rows] tensor per decoding step

    def begin(self, envs: list) -> None:
        self.envs, self.started, self.steps = list(envs), {}, []

    def _start(self, j: int, ids: torch.Tensor | None, text: str | None = None) -> None:
        def run() -> tuple[str, Observation, str | None]:
            # decoded as `generate` decodes a row (end token and special tokens dropped); `result` checks they agree
            said = text if ids is None else \
                self.tokenizer.decode(ids[~torch.isin(ids, self.eos)].tolist(), skip_special_tokens=True)
            return (said, *step_env(self.envs[j], said))

        self.started[j] = self.pool.submit(run)

    def watch(self, on_token: OnToken) -> OnToken:
        """`on_token` (the rows' budgets), plus: a row whose sampled token ends its turn has its step started."""
        if self.pool is None:
            return on_token

        def watched(tokens: torch.Tensor, alive: torch.Tensor):
            self.steps.append(tokens.cpu())
            ended = (alive.cpu() & torch.isin(self.steps[-1], self.eos)).nonzero().flatten().tolist()
            if ended:
                sampled = torch.stack(self.steps, 1)
                for j in ended:
                    self._start(j, sampled[j])
            return on_token(tokens, alive)

        return watched

    def start_rest(self, out: Rollout) -> None:
        """Start every row of the call's `out` that ended its turn with an end token and has no step yet (a call that
        was not watched: vLLM's), with the call's own text."""
        if self.pool is None:
            return
        for j in range(len(self.envs)):
            n = int(out.completion_mask[j].sum())
            if j not in self.started and n and bool(torch.isin(out.completion_ids[j, n - 1].cpu(), self.eos)):
                self._start(j, None, out.texts[j])

    def result(self, j: int, text: str) -> tuple[Observation, str | None]:
        future = self.started.pop(j, None)
        if future is None:
            return step_env(self.envs[j], text)
        stepped, obs, error = future.result()
        if stepped != text:  # (an invariant: the early decode must be the call's own text)
            raise RuntimeError(f"internal error: the environment was stepped with {stepped!r}, the turn's text is "
                               f"{text!r}; set agent.env_workers=1 and report this")
        return obs, error

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
