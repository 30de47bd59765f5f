"""python -m jaxtrain.report: the panels and series of two runs; the console progress bar."""
import io
import json

import jax
import pytest
from rich.console import Console

from jaxtrain.analysis import report
from jaxtrain.analysis import report as report_cli
from jaxtrain.metrics.console import Reporter
from jaxtrain.train import fit


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, corpus_path):
    from conftest import SMALL

    from jaxtrain import config as cfglib
    root = tmp_path_factory.mktemp("report")
    runs = []
    for name, lr in (("lr3", "1e-3"), ("lr10", "1e-2")):
        cfg = cfglib.load(None, [*SMALL, f"data.path={corpus_path}", f"run.dir={root / name}", "train.steps=6",
                                 "train.eval_every=3", "checkpoint.enabled=false", "mesh.data=1",
                                 f"optimizer.lr={lr}", "optimizer.min_lr=1e-4"])
        runs.append(fit(cfg, devices=jax.devices()[:1], quiet=True).run_dir)
    return runs


def test_report_overlays_runs_in_six_panels(two_runs, tmp_path, capsys):
    fig = report.figure(two_runs)
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["loss vs step", "loss vs tokens", "learning rate", "gradient norm",
                                               "throughput (tokens/s)", "MFU (%)"]
    assert [ln.get_label() for ln in axes[0].lines] == ["lr3 train", "lr3 val", "lr10 train", "lr10 val"]
    for run, train_line, val_line in ((two_runs[0], *axes[0].lines[:2]), (two_runs[1], *axes[0].lines[2:])):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if "loss" in r]
        assert list(train_line.get_xdata()) == [r["step"] for r in train]
        assert list(train_line.get_ydata()) == [r["loss"] for r in train]
        assert list(val_line.get_ydata()) == [r["val_loss"] for r in rows if "val_loss" in r]
    # Tokens: global_batch 8 x seq_len 32 per step; the learning rates differ by their peak.
    assert list(axes[1].lines[0].get_xdata()) == [256 * s for s in range(1, 7)]
    assert max(axes[2].lines[1].get_ydata()) == pytest.approx(10 * max(axes[2].lines[0].get_ydata()), rel=1e-6)
    out = tmp_path / "r.png"
    assert report_cli.main([*map(str, two_runs), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert report_cli.main([str(tmp_path), "-o", str(out)]) == 2
    assert capsys.readouterr().err == (f"error: report: '{tmp_path}' is not a run directory with metrics "
                                       f"(config.yaml, metrics.jsonl)\n")
    (two_runs[0] / "metrics.jsonl").write_text("")  # started, no step logged yet: nothing to plot
    assert report_cli.main([*map(str, two_runs), "-o", str(tmp_path / "e.png")]) == 2
    assert capsys.readouterr().err == (f"error: report: {two_runs[0] / 'metrics.jsonl'} has no train rows yet (the "
                                       f"run logged no step)\n")
    assert not (tmp_path / "e.png").exists()


def test_progress_bar_shows_loss_throughput_and_mfu_on_a_terminal_only():
    buffer = io.StringIO()
    out = Reporter(quiet=False, total=10, console=Console(file=buffer, force_terminal=True, width=160))
    with out.progress(0):
        with out.status("compiling the train step"):
            out._progress.refresh()
            assert "compiling the train step..." in buffer.getvalue()
        out.advance(4, "loss 1.2345 | 9,876 tokens/s | MFU 12.3%")
        out._progress.refresh()
    assert "loss 1.2345 | 9,876 tokens/s | MFU 12.3%" in buffer.getvalue() and "4/10" in buffer.getvalue()
    plain = io.StringIO()
    log = Reporter(quiet=False, total=10, console=Console(file=plain, force_terminal=False))
    assert log.quiet  # a log file or CI: no bar, no spinner, only the lines
    with log.status("compiling"), log.progress(0):
        log.advance(4, "loss 1.0")
        log.info("step      4 | loss 1.0000")
    assert plain.getvalue() == "step      4 | loss 1.0000\n"
