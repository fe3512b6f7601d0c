"""The job's inputs: the datasets `vlmrl train` loads (before any run directory exists, so bad input stops it early)
and the stream of RL prompts, whose order is part of the state a checkpoint saves."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlmrl.config import Config
from vlmrl.data import build_dataset


class PromptStream:
    """Shuffled passes over the RL prompts, driven by one generator so data order is part of the resumable state."""

    def __init__(self, n: int, generator: torch.Generator):
        self.n, self.generator = n, generator
        self.order, self.pos, self.epoch = torch.randperm(n, generator=generator).tolist(), 0, 0

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos == self.n:
                self.order, self.pos, self.epoch = torch.randperm(self.n, generator=self.generator).tolist(), 0, \
                    self.epoch + 1
            take = min(k - len(out), self.n - self.pos)
            out += self.order[self.pos:self.pos + take]
            self.pos += take
        return out

    def state(self) -> dict:
        return {"order": self.order, "pos": self.pos, "epoch": self.epoch}

    def load(self, state: dict) -> None:
        self.order, self.pos, self.epoch = state["order"], state["pos"], state["epoch"]


@dataclass
class Datasets:
    """The job's samples: RL prompts, held-out evaluation, SFT labels, and what loading skipped (data.on_error)."""

    train: list[dict]
    eval: list[dict]
    sft: list[dict]
    reports: list
    replay: list[dict] = field(default_factory=list)  # labelled samples the RL update replays (replay.weight > 0)

    @property
    def skipped(self) -> int:
        return sum(r.skipped for r in self.reports)


def load_datasets(cfg: Config) -> Datasets:
    d = cfg.data
    train_set, report = build_dataset(d.train, "train", d.seed, d.on_error)
    eval_set, eval_report = build_dataset(d.eval, "test", d.seed, d.on_error)
    reports = [r for r in (report, eval_report) if r is not None]
    sft_set, replay_set = [], []
    replay_sft = cfg.replay.weight > 0 and cfg.replay.data is None  # replay defaults to the SFT labels
    if cfg.sft.steps > 0 or replay_sft:
        sft_set, sft_report = build_dataset(d.sft, "train", d.seed + 1, d.on_error)
        reports += [sft_report] if sft_report is not None else []
    if cfg.replay.weight > 0:
        replay_set = sft_set
        if cfg.replay.data is not None:
            replay_set, replay_report = build_dataset(cfg.replay.data, "train", d.seed + 3, d.on_error)
            reports += [replay_report] if replay_report is not None else []
    return Datasets(train_set, eval_set, sft_set, reports, replay_set)
