"""Console output: info lines, warning tables, a rich progress bar with ETA (``run.progress``)."""
from __future__ import annotations

import contextlib
import re
from typing import Optional

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

# Unicode's control characters (C0, DEL, C1) but newline and tab: printed raw, ESC or CSI start terminal
# escape sequences (an early byte-level sample is random bytes, ~1 in 256 of them ESC).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with each control character but newline and tab written as its escape (``\\x1b``)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def format_flops(flops_per_s: Optional[float]) -> str:
    """'1.23 TFLOP/s', '312.0 GFLOP/s' or 'n/a'."""
    if not flops_per_s:
        return "n/a"
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if flops_per_s >= scale:
            return f"{flops_per_s / scale:.1f} {unit}"
    return f"{flops_per_s:.3g} FLOP/s"


class Reporter:
    """Prints to stdout. On a terminal it also shows a progress bar (not when ``quiet``) and
    spinners for slow phases; elsewhere (a log file, CI) only plain lines are printed; when
    ``silent``, nothing at all."""

    def __init__(self, quiet: bool, total: int, console: Optional[Console] = None, silent: bool = False):
        # silent: a multi-process run's processes other than 0 print nothing (one voice)
        self.console = console or Console(stderr=False, highlight=False, quiet=silent)
        self.quiet = quiet or not self.console.is_terminal
        self.total = total
        self._progress: Optional[Progress] = None
        self._task = None

    def info(self, msg: str) -> None:
        self.console.print(msg, soft_wrap=True)

    def line(self, text: str) -> None:
        """Prints ``text`` as it is (no markup read in it). Off a terminal it goes straight to the
        console's file: rich's rendering of a metrics row took ~0.3 ms, ~1% of a shakespeare-char step
        with a row a step (as nanoGPT prints them, with ``print``); on one, through rich, which keeps
        the progress bar below the line."""
        if self.console.quiet:
            return
        if self.console.is_terminal:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)
            return
        self.console.file.write(text + "\n")
        self.console.file.flush()

    def warn_table(self, title: str, rows: list[str]) -> None:
        table = Table(title=f"[yellow]warning: {title}")
        table.add_column("dimension")
        for row in rows:
            table.add_row(row)
        self.console.print(table)

    @contextlib.contextmanager
    def progress(self, start: int):
        if self.quiet or start >= self.total:
            yield
            return
        self._progress = Progress(SpinnerColumn(), TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                  TextColumn("{task.fields[stats]}"),
                                  console=self.console, transient=True)
        self._task = self._progress.add_task("train", total=self.total, completed=start, stats="")
        with self._progress:
            yield
        self._progress = None

    def advance(self, step: int, stats: Optional[str] = None) -> None:
        """Moves the bar to ``step``; ``stats`` (e.g. 'loss 1.2345 | 12,000 tokens/s') replaces its text."""
        if self._progress is not None:
            fields = {} if stats is None else {"stats": stats}
            self._progress.update(self._task, completed=step, **fields)

    @contextlib.contextmanager
    def status(self, message: str):
        """``message`` with a spinner while the block runs: in the progress bar when it is up, else on
        its own line (on a terminal only; elsewhere nothing is shown)."""
        if self._progress is not None:
            self._progress.update(self._task, stats=f"{message}...")
            yield
            self._progress.update(self._task, stats="")
        elif self.quiet:
            yield
        else:
            with self.console.status(message):
                yield

    def text(self, title: str, text: str) -> None:
        """``title:`` then ``text`` verbatim (no markup; control characters escaped: :func:`printable`),
        e.g. a generated sample."""
        self.console.print(f"{title}:")
        self.console.print(printable(text), markup=False, soft_wrap=True)
