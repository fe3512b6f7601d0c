"""Progress hooks. Library code reports progress through a `Progress` object and never prints; `Progress` itself
does nothing. The command lines (`vlmrl train`, `vlmrl reclip`, `vlmrl serve`, ...) pass a `BarProgress`, which
draws tqdm bars on stderr. Only CLI modules construct a `BarProgress`."""

from __future__ import annotations

import sys


class Progress:
    """No-op progress hooks; `BarProgress` draws them as bars."""

    def start(self, phase: str, total: int) -> None: ...
    def advance(self, n: int = 1, **postfix) -> None: ...
    def end(self) -> None: ...
    def message(self, text: str) -> None: ...


class BarProgress(Progress):
    """tqdm bars (and one line per message) on stderr for the library's Progress hooks."""

    def __init__(self):
        self.bar = None

    def start(self, phase: str, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=phase, dynamic_ncols=True, file=sys.stderr)

    def advance(self, n: int = 1, **postfix) -> None:
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)

    def end(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def message(self, text: str) -> None:
        print(text, file=sys.stderr)
