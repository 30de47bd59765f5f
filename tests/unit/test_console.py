"""The console's plain lines: a metrics row is written as it is (no markup read in it, the same text
rich printed), and a silent reporter (a multi-process run's other processes) prints nothing."""
import io

from rich.console import Console

from jaxtrain.metrics.console import Reporter
from jaxtrain.metrics.sinks import ConsoleSink


def reporter(silent: bool = False) -> tuple[Reporter, io.StringIO]:
    buf = io.StringIO()  # not a terminal, as in a log file or CI
    return Reporter(quiet=False, total=10, console=Console(file=buf, highlight=False, quiet=silent),
                    silent=silent), buf


def test_a_line_is_written_as_it_is_and_a_train_row_reads_as_before():
    out, buf = reporter()
    out.line("step      3 | aux [red]x[/] 1.0")
    out.info("[red]step[/] 3")  # info reads markup
    assert buf.getvalue() == "step      3 | aux [red]x[/] 1.0\nstep 3\n"
    out, buf = reporter()
    ConsoleSink(out).write(7, {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_sec": 12345.6,
                               "step_time_s": 0.0321, "mfu": 0.654, "step_time_extra": 1.5})
    ConsoleSink(out).write(7, {"val_loss": 2.25, "eval_time_s": 0.7})
    assert buf.getvalue().splitlines() == [
        "step      7 | loss 2.5000 | lr 1.00e-03 | grad_norm 0.500 | 12,346 tokens/s | 32.1 ms/step | MFU 65.4%"
        " | step_time_extra 1.5000",
        "step      7 | val_loss 2.2500"]


def test_a_silent_reporter_prints_no_line():
    out, buf = reporter(silent=True)
    out.line("step 1")
    out.info("step 1")
    assert buf.getvalue() == ""
