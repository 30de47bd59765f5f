"""benchmarks/step.py's RESULTS.md row: its figures, and that it lands in compare.py's table, not under
whatever table ends the file (the GPU rows of 2026-12-04 were appended after the MoE kernel table)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _bench  # noqa: E402
import step  # noqa: E402


def _info(**extra):
    return {"config": "llama_1b_h200", "overrides": ["data.path=stdlib"], "device": "NVIDIA H200",
            "n_devices": 1, "tokens_per_sec": 75658.4, "mfu": 0.5382, "peak_source": "table (NVIDIA H200, bfloat16)",
            "compile_s": 8.44, "stats": {"steps": 30}, "dtype": "bfloat16", "jax": "0.11.2", "gpu_flags": True, **extra}


def test_row_names_the_figures_and_the_users_xla_flags():
    row = step.results_row(_info(users_xla_flags="--xla_gpu_enable_triton_gemm=false"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == _bench.STEP_TABLE_HEADER.count("|") - 1
    assert cells[3:6] == ["llama_1b_h200 data.path=stdlib", "75,658", "-"]
    assert cells[9] == "MFU 53.8% (table (NVIDIA H200, bfloat16))"
    assert cells[10] == "8.4"
    assert cells[11] == ("step.py, 30 steps, bfloat16, jax 0.11.2, GPU XLA flags, "
                         "XLA_FLAGS=--xla_gpu_enable_triton_gemm=false")
    assert "XLA_FLAGS" not in step.results_row(_info(users_xla_flags=""))


def test_row_lands_in_the_step_table_not_at_the_end_of_the_file(tmp_path):
    results = tmp_path / "RESULTS.md"
    other = "| date (UTC) | hardware | commit | case | ms |"
    results.write_text("\n".join(["# Benchmark results", "", _bench.STEP_TABLE_HEADER, "|---|", "| old step row |",
                                  "", other, "|---|", "| kernel row |"]) + "\n")
    _bench.append_result_row(_bench.STEP_TABLE_HEADER, step.results_row(_info()), path=results)
    lines = results.read_text().splitlines()
    assert lines[4] == "| old step row |" and "llama_1b_h200" in lines[5] and lines[6] == ""
    assert lines[-1] == "| kernel row |"
