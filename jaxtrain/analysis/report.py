"""Plots of one or more runs from their ``metrics.jsonl``: ``python -m jaxtrain.report RUN [RUN ...] -o FILE.png``.

Six panels, every run overlaid (labelled by its directory): train and validation loss against
step and against tokens (examples for a non-LM model; ``train.global_batch`` x ``data.seq_len``
per step, from the run's ``config.yaml``), the learning rate, the gradient norm, the throughput
and MFU. Drawn with matplotlib's Agg backend (no display needed).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import yaml

from jaxtrain.cli.common import cli, prog
from jaxtrain.errors import ConfigError
from jaxtrain.metrics.sinks import read_metrics

PANELS = ("loss vs step", "loss vs {unit}", "learning rate", "gradient norm", "throughput ({unit}/s)", "MFU (%)")


def _labels(run_dirs: Sequence[Path]) -> list[str]:
    names = [p.name for p in run_dirs]
    return names if len(set(names)) == len(names) else [str(p) for p in run_dirs]


def load(run_dir: Path) -> tuple[list[dict], list[dict], str, int]:
    """(train rows, eval rows, unit, units per step) of a run directory.

    Raises:
      ConfigError: not a run directory with metrics (no config.yaml or metrics.jsonl), or no train row.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file() or not (run_dir / "metrics.jsonl").is_file():
        raise ConfigError(f"report: '{run_dir}' is not a run directory with metrics (config.yaml, metrics.jsonl)")
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        per_example = cfg["data"]["seq_len"], cfg["train"]["global_batch"]
    except (yaml.YAMLError, UnicodeDecodeError, TypeError, KeyError) as err:
        raise ConfigError(f"report: {run_dir / 'config.yaml'} is not a run's config ({type(err).__name__}: "
                          f"{err})") from None
    rows = read_metrics(run_dir)
    train = [r for r in rows if "step_time_s" in r]
    if not train:  # six empty panels would say nothing
        raise ConfigError(f"report: {run_dir / 'metrics.jsonl'} has no train rows yet (the run logged no step)")
    unit = "examples" if any("examples_per_sec" in r for r in train) else "tokens"
    per_step = per_example[1] * (per_example[0] if unit == "tokens" else 1)
    return train, [r for r in rows if "val_loss" in r], unit, per_step


def figure(run_dirs: Sequence[Path]):
    """A matplotlib Figure with the panels of the module docstring for ``run_dirs``."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    runs = [load(p) for p in run_dirs]
    unit = runs[0][2] if len({r[2] for r in runs}) == 1 else "units"
    fig = Figure(figsize=(15, 8.5), layout="constrained")
    axes = fig.subplots(2, 3).ravel()
    for ax, title in zip(axes, PANELS):
        ax.set_title(title.format(unit=unit))
        ax.set_xlabel("step" if "vs {unit}" not in title else unit)
        ax.grid(alpha=0.3)
    for (train, evals, run_unit, per_step), label in zip(runs, _labels([Path(p) for p in run_dirs])):
        steps = [r["step"] for r in train]
        line, = axes[0].plot(steps, [r["loss"] for r in train], label=f"{label} train")
        color = line.get_color()
        if evals:
            axes[0].plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o--", color=color,
                         label=f"{label} val")
        axes[1].plot([s * per_step for s in steps], [r["loss"] for r in train], color=color, label=f"{label} train")
        if evals:
            axes[1].plot([r["step"] * per_step for r in evals], [r["val_loss"] for r in evals], "o--", color=color,
                         label=f"{label} val")
        axes[2].plot(steps, [r["lr"] for r in train], color=color, label=label)
        axes[3].plot(steps, [r["grad_norm"] for r in train], color=color, label=label)
        axes[4].plot(steps, [r[f"{run_unit}_per_sec"] for r in train], color=color, label=label)
        mfu = [(s, 100 * r["mfu"]) for s, r in zip(steps, train) if r.get("mfu") is not None]
        axes[5].plot([s for s, _ in mfu], [m for _, m in mfu], color=color, label=label)
    for ax in axes:
        if ax.lines:
            ax.legend(fontsize="small")
    return fig


FORMATS = (".png", ".svg", ".pdf")


def write(run_dirs: Sequence[Path], out: Path, dpi: int = 110) -> Path:
    """Saves :func:`figure` of ``run_dirs`` at ``out`` (a PNG, or SVG or PDF by its suffix).

    Raises:
      ConfigError: a bad run dir, or ``out`` has another suffix (checked before any figure is drawn).
    """
    out = Path(out)
    if out.suffix.lower() not in FORMATS:
        raise ConfigError(f"report: -o {out}: the file must end in {', '.join(FORMATS)}")
    fig = figure(run_dirs)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    return out



def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=prog("jaxtrain.report"),
                                     description="Loss, learning rate, gradient norm, throughput and MFU of "
                                                 "one or more runs, overlaid, as a PNG.")
    parser.add_argument("run_dirs", nargs="+", help="run directories (each with config.yaml and metrics.jsonl)")
    parser.add_argument("-o", "--out", required=True, help="the PNG to write")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    def body() -> None:
        print(f"wrote {write([Path(p) for p in args.run_dirs], Path(args.out))}")
    return cli(body)


if __name__ == "__main__":
    sys.exit(main())
