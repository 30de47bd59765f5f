"""The project runs from a source checkout without installation (a GPU machine with no network may
not be able to ``pip install -e .``): ``jaxtrain.models``, the configs and the rule sets resolve."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Hides the editable install (its meta-path finder and .pth path entries), then imports from REPO.
SNIPPET = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()
                    and "editable" not in type(f).__module__.lower()]
sys.path[:] = [sys.argv[1]] + [p for p in sys.path if "__editable__" not in p]
import jaxtrain.models.registry
from jaxtrain.config import load
cfg = load("shakespeare_char", ["sharding.rules=fsdp"])
from jaxtrain.parallel.rules import Rules
print(jaxtrain.models.__file__, cfg.model.family, Rules.from_config(cfg.sharding).name)
"""


def test_runs_from_the_checkout_without_installation():
    out = subprocess.run([sys.executable, "-c", SNIPPET, str(REPO)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [str(REPO / "models" / "__init__.py"), "llama", "fsdp"]
