"""A progress bar on stderr: loss, tokens/s and time left, with no dependency.

On a terminal the bar redraws one line in place and notes (validation, checkpoints) print
above it. Anywhere else (a log file, CI) redrawing would leave junk, so it prints a plain
line about every 5% of the run instead.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

__all__ = ["Progress", "format_duration"]

_WIDTH = 24  # characters of the bar itself


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """Progress of steps ``start`` .. ``total``; see the module docstring."""

    def __init__(self, total: int, start: int = 0, stream: TextIO | None = None) -> None:
        self.total = total
        self.start = start
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty()
        self.every = max(1, (total - start) // 20)
        self.began = time.perf_counter()
        self.line = ""

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Step ``step`` (1-based count of completed steps) just finished."""
        done = step - self.start
        elapsed = time.perf_counter() - self.began
        eta = elapsed / max(done, 1) * (self.total - step)
        stats = f"loss {loss:.3f} | {tokens_per_s:,.0f} tok/s | ETA {format_duration(eta)}"
        if self.live:
            filled = _WIDTH * step // self.total
            bar = "#" * filled + "." * (_WIDTH - filled)
            self.line = f"[{bar}] {step}/{self.total} {stats}"
            self._draw()
        elif done % self.every == 0 or step == self.total:
            self.stream.write(f"step {step}/{self.total} {stats}\n")
            self.stream.flush()

    def note(self, text: str) -> None:
        """A message that stays (above the bar on a terminal)."""
        if self.live:
            self.stream.write("\r\033[K" + text + "\n")
            self._draw()
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.live and self.line:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self) -> None:
        width = shutil.get_terminal_size((100, 20)).columns
        self.stream.write("\r\033[K" + self.line[: width - 1])
        self.stream.flush()
