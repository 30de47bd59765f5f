"""The notebooks run top to bottom through nbclient (8 simulated CPU devices), and are committed with
their outputs so they read on GitHub without running. After changing one, refresh its outputs with
``python tests/test_notebook.py notebooks/NAME.ipynb``."""
import os
import sys
from pathlib import Path

import nbformat
import pytest
import xla_test_flags
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
EXPECT = {  # an output line each notebook must print (values follow from the shipped configs and rules)
    "sharding_experiments.ipynb": "fsdp_tp  w_up P('fsdp', 'tensor') ",
    "mesh_explorer.ipynb": "ep       2,2,1,1,2",
}


def execute(path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    # The kernel's own environment: 8 simulated CPU devices, whatever this process was told.
    env = {**os.environ, "XLA_FLAGS": xla_test_flags.with_devices(8), "JAX_PLATFORMS": "cpu"}
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=env)
    return nb


def text_of(nb: nbformat.NotebookNode) -> str:
    return "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_every_notebook_is_listed():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(EXPECT)


@pytest.mark.parametrize("name", sorted(EXPECT))
@pytest.mark.slow  # over ~20 s on 2 cores (CI's durations)
def test_notebook_runs_and_is_committed_with_its_outputs(name):
    committed = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(c.get("outputs") for c in committed.cells if c.cell_type == "code"), "commit it with outputs"
    assert EXPECT[name] in text_of(committed)
    nb = execute(NOTEBOOKS / name)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert errors == []
    assert EXPECT[name] in text_of(nb)
    if name == "mesh_explorer.ipynb":  # the plot came out as an image
        assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


if __name__ == "__main__":  # refresh the committed outputs of the notebooks named on the command line
    for arg in sys.argv[1:]:
        nbformat.write(execute(Path(arg).resolve()), Path(arg))
        print(f"executed and saved {arg}")
