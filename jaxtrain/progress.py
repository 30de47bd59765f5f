"""Console output: a rich progress bar with ETA, per-log-step lines, the final report."""
from __future__ import annotations

import contextlib
from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


def format_flops(flops_per_s: Optional[float]) -> str:
    """'1.23 TFLOP/s', '312.0 GFLOP/s' or 'n/a'."""
    if not flops_per_s:
        return "n/a"
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if flops_per_s >= scale:
            return f"{flops_per_s / scale:.1f} {unit}"
    return f"{flops_per_s:.3g} FLOP/s"


class Reporter:
    def __init__(self, quiet: bool, total: int):
        self.console = Console(stderr=False, highlight=False)
        self.quiet = quiet
        self.total = total
        self._progress: Optional[Progress] = None
        self._task = None

    def info(self, msg: str) -> None:
        self.console.print(msg, soft_wrap=True)

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
        self._progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                  TextColumn("eta"), TimeRemainingColumn(), console=self.console,
                                  transient=True)
        self._task = self._progress.add_task("train", total=self.total, completed=start)
        with self._progress:
            yield
        self._progress = None

    def advance(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def log_train(self, row: dict) -> None:
        mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "n/a"
        self.console.print(
            f"step {row['step']:>6} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | grad_norm "
            f"{row['grad_norm']:.3f} | {row['tokens_per_sec']:,.0f} tokens/s | {row['step_time_s'] * 1e3:.1f} "
            f"ms/step | MFU {mfu}", soft_wrap=True)

    def log_eval(self, row: dict) -> None:
        self.console.print(f"step {row['step']:>6} | val_loss {row['val_loss']:.4f}", soft_wrap=True)

    def final(self, val_loss: float, n_batches: int, sample: str) -> None:
        self.console.print(f"validation loss {val_loss:.4f} (mean over {n_batches} batches)")
        self.console.print("sample:")
        self.console.print(sample, markup=False, soft_wrap=True)
