"""The progress display on stderr: loss, tokens/s, MFU and time left.

On a terminal, with ``rich`` installed (``pip install 'plait[train]'``), a ``rich``
progress bar redraws in place and notes (validation, checkpoints) print above it.
Anywhere else (a log file, CI), or without ``rich`` (the display is not essential: no
error), it prints a plain line about every 5% of the run instead, and every note as a
line of its own::

    step 30/300 loss 2.413 | 51,203 tok/s | MFU 3.42% | ETA 1:05
"""

from __future__ import annotations

import atexit
import sys
import time
from typing import Any, TextIO

__all__ = ["Progress", "format_duration", "format_mfu"]


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def format_mfu(mfu: float | None) -> str:
    """``mfu`` (a fraction) as a percentage with three significant digits; "-" if
    unknown."""
    return "-" if mfu is None else f"{mfu * 100:.3g}%"


def _stats(loss: float, tokens_per_s: float, mfu: float | None) -> str:
    return f"loss {loss:.3f} | {tokens_per_s:,.0f} tok/s | MFU {format_mfu(mfu)}"


class _RichBar:
    """The terminal display: a ``rich.progress`` bar (imported here: optional)."""

    def __init__(self, total: int, start: int, stream: TextIO, force: bool) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        console = Console(file=stream, force_terminal=force or None, highlight=False)
        self.bar = RichProgress(
            TextColumn("step"),
            BarColumn(bar_width=None),  # what the text leaves: a narrow terminal keeps the text
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]} | ETA"),
            TimeRemainingColumn(compact=True),
            console=console,
            expand=True,
            refresh_per_second=4,
        )
        waiting = "loss - | - tok/s | MFU -"  # until the first step
        self.task = self.bar.add_task("train", total=total, completed=start, stats=waiting)
        self.bar.start()
        # rich hides the cursor while it draws: a run that dies before close() must still
        # give the terminal its cursor back.
        atexit.register(self.close)

    def update(self, step: int, stats: str) -> None:
        self.bar.update(self.task, completed=step, stats=stats)

    def note(self, text: str) -> None:
        self.bar.console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        atexit.unregister(self.close)
        self.bar.stop()


class Progress:
    """Progress of steps ``start`` .. ``total``; see the module docstring.

    ``live``: draw the ``rich`` bar; by default when ``stream`` (stderr) is a terminal.
    Without ``rich`` the plain lines are printed whatever ``live`` says.
    """

    def __init__(
        self, total: int, start: int = 0, stream: TextIO | None = None, live: bool | None = None
    ) -> None:
        self.total = total
        self.start = start
        self.stream = stream if stream is not None else sys.stderr
        self.every = max(1, (total - start) // 20)
        self.began = time.perf_counter()
        self._bar: Any = None  # a _RichBar when drawing one
        if self.stream.isatty() if live is None else live:
            try:
                self._bar = _RichBar(total, start, self.stream, force=bool(live))
            except ImportError:
                self._bar = None  # no rich: the plain lines

    @property
    def live(self) -> bool:
        """Whether the ``rich`` bar is drawn (else plain lines)."""
        return self._bar is not None

    def update(self, step: int, loss: float, tokens_per_s: float, mfu: float | None = None) -> None:
        """Step ``step`` (1-based count of completed steps) just finished; ``mfu``: its
        model FLOPs utilisation (a fraction), None if unknown."""
        stats = _stats(loss, tokens_per_s, mfu)
        if self._bar is not None:
            self._bar.update(step, stats)
            return
        done = step - self.start
        if done % self.every == 0 or step == self.total:
            elapsed = time.perf_counter() - self.began
            eta = elapsed / max(done, 1) * (self.total - step)
            self.stream.write(f"step {step}/{self.total} {stats} | ETA {format_duration(eta)}\n")
            self.stream.flush()

    def note(self, text: str) -> None:
        """A message that stays (above the bar on a terminal)."""
        if self._bar is not None:
            self._bar.note(text)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        """Stop drawing (the bar stays as last drawn); safe to call twice."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
