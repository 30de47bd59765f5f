"""notebooks/sharding_experiments.ipynb: its code cells run top to bottom (8 simulated CPU devices)."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "sharding_experiments.ipynb"


def test_sharding_notebook_runs(corpus_path):
    cells = [c for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    code = "\n\n".join("".join(c["source"]) for c in cells)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=NOTEBOOK.parent, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fsdp_tp  w_up P('fsdp', 'tensor') " in proc.stdout
    assert "collectives per step (bytes per device): all-gather " in proc.stdout
