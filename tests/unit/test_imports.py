"""jaxtrain.runtime.imports.lean(): the command line's JAX import without two scans it does not need."""
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxtrain.kernels.cpu import lean_imports as imports

SCAN = "from importlib.metadata import distributions\nnames = [d.metadata.get('Name', '') for d in distributions()]"


def _scan_as(module: str) -> list:
    scope = {"__name__": module}
    exec(SCAN, scope)  # noqa: S102 - the scan as that module runs it
    return scope["names"]


def test_only_jaxs_rocm_scan_is_narrowed_and_still_finds_a_plugin(tmp_path, monkeypatch):
    info = tmp_path / "jax_rocm7_plugin-0.8.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: jax-rocm7-plugin\nVersion: 0.8.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    everything = _scan_as("some.module")
    assert "jax-rocm7-plugin" in everything and len(everything) > 10
    with imports.lean():
        assert _scan_as("jax._src.numpy.array_constructors") == ["jax-rocm7-plugin"]
        assert sorted(_scan_as("some.module")) == sorted(everything)  # any other caller: the full list
    assert importlib.metadata.distributions.__module__ == "importlib.metadata"  # put back


def test_ipython_cannot_be_imported_inside_unless_it_already_was(monkeypatch):
    pytest.importorskip("IPython")
    monkeypatch.delitem(sys.modules, "IPython")
    with imports.lean():
        with pytest.raises(ImportError):
            import IPython  # noqa: F401
    import IPython  # noqa: F401,F811 - importable again after the block
    assert sys.modules["IPython"] is not None
    with imports.lean():  # already imported (a main() called from a notebook): left as it is
        import IPython  # noqa: F401,F811
        assert sys.modules["IPython"] is not None


def test_the_command_line_imports_flax_without_ipython(tmp_path):
    """The config's model family brings in Flax; the command line loads the config under lean()."""
    pytest.importorskip("IPython")
    repo = Path(__file__).resolve().parents[2]
    script = ("import sys, jaxtrain.train\n"
              "jaxtrain.train.fit = lambda cfg: print('flax' in sys.modules, 'IPython' in sys.modules)\n"
              "from jaxtrain.cli.train import main\n"
              f"sys.exit(main(['--config', 'configs/shakespeare_char.yaml', 'run.dir={tmp_path / 'run'}']))\n")
    env = {**os.environ, "JAXTRAIN_PROGRAM_CACHE": "0"}
    done = subprocess.run([sys.executable, "-c", script], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]
