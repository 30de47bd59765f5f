"""Shared helpers of the benchmark scripts: statistics, tables, JSON, the worker protocol.

A benchmark *worker* (``step.py --serve``, ``torch_reference.py --serve``)
sets up and compiles once, prints one JSON line ``{"ready": {...}}``, then
answers each stdin line ``run N`` with one JSON line ``{"times": [...], ...}``
(seconds per step, N steps), and ``quit`` ends it. compare.py drives several
workers in alternation so that each sees the same machine conditions.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parent.parent
HERE_RESULTS = REPO / "benchmarks" / "RESULTS.md"
# The table of compare.py's rows and of step.py's (GPU) rows, which leave the torch columns empty.
STEP_TABLE_HEADER = ("| date (UTC) | hardware | commit | config | jaxtrain tok/s | torch eager tok/s "
                     "| torch.compile tok/s | vs eager | vs compile | of peak | jax compile s | notes |")
sys.path.insert(0, str(REPO))


def default_corpus() -> str:
    """The tinyshakespeare corpus: $JAXTRAIN_SHARED/data/..., else ../shared/data/... beside the checkout."""
    shared = os.environ.get("JAXTRAIN_SHARED", str(REPO.parent / "shared"))
    return str(Path(shared) / "data" / "tinyshakespeare.txt")


def with_corpus(overrides: list[str]) -> list[str]:
    """Adds ``data.path=<tinyshakespeare>`` unless the overrides already set data.path."""
    if any(o.startswith("data.path=") for o in overrides):
        return list(overrides)
    return [f"data.path={default_corpus()}", *overrides]


def stats(times: list[float]) -> dict:
    """median / mean / min / max / p10 / p90 of step times (s) and the relative spread (p90-p10)/median."""
    xs = sorted(times)
    q = statistics.quantiles(xs, n=10) if len(xs) >= 2 else [xs[0]] * 9
    med = statistics.median(xs)
    return {"steps": len(xs), "median_s": med, "mean_s": statistics.fmean(xs), "min_s": xs[0], "max_s": xs[-1],
            "p10_s": q[0], "p90_s": q[-1], "spread": (q[-1] - q[0]) / med if med else None}


def peak_host_rss_bytes() -> int:
    """Peak resident set size of this process (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def fmt(x, unit: str = "", scale: float = 1.0, digits: int = 1) -> str:
    if x is None:
        return "n/a"
    return f"{x / scale:,.{digits}f}{unit}"


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    print("-" * (width + 30))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def write_json(path: Optional[str], obj: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=2) + "\n")
        print(f"wrote {path}")


def serve(ready: dict, run_steps: Callable[[int], dict]) -> None:
    """The worker loop (see module docstring). ``run_steps(n)`` returns {'times': [...], ...}."""
    out = sys.stdout
    print(json.dumps({"ready": ready}), file=out, flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "run":
            print(json.dumps(run_steps(int(cmd[1]))), file=out, flush=True)


def hardware() -> str:
    """CPU model and core count (and the accelerator's kind, if ``device`` is given)."""
    model = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()}"


def commit() -> str:
    """Short git commit of the checkout, '+dirty' when tracked files differ from it (RESULTS.md aside: the
    rows a benchmark run appends there are not a change to the code measured)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/RESULTS.md"],
                               cwd=REPO, capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def append_result_row(header: str, row: str, intro: str = "", path: Path = HERE_RESULTS) -> None:
    """Appends ``row`` to the table of RESULTS.md whose header line is ``header`` (after its last
    row), or starts that table at the end of the file, after ``intro``, if there is none yet."""
    lines = path.read_text().splitlines() if path.exists() else ["# Benchmark results", ""]
    if header in lines:
        at = lines.index(header) + 2  # past the |---| line
        while at < len(lines) and lines[at].startswith("|"):
            at += 1
        lines.insert(at, row)
    else:
        lines += ["", *( [intro, ""] if intro else []), header, "|" + "---|" * (header.count("|") - 1), row]
    path.write_text("\n".join(lines) + "\n")


def append_result_rows(header: str, rows: list[str], intro: str = "", path: Path = HERE_RESULTS) -> None:
    """:func:`append_result_row` for each of ``rows``, in order, then says how many were appended."""
    for row in rows:
        append_result_row(header, row, intro, path)
    print(f"appended {len(rows)} rows to {path}")
