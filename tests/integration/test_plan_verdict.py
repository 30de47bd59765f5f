"""``python -m jaxtrain.plan --device-memory``: an overall verdict, and exit 2 when no candidate fits (it
compiles every candidate and its remat and offload layouts: ~30 s on 2 cores)."""
import pytest
from conftest import SMALL

from jaxtrain.analysis import plan as plan_cli


@pytest.mark.slow
def test_plan_says_whether_anything_fits_the_device_memory_and_exits_2_when_nothing_does(capsys):
    """``plan --device-memory X && train`` must be able to act on the verdict (5eb7ae3: exit 0, no verdict)."""
    base = ["--devices", "2", "--rules", "dp", "model.vocab_size=256", *SMALL]
    assert plan_cli.main([*base, "--device-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "\nverdict: 2 of 2 compiled candidates fit --device-memory 1GiB (best: dp " in out
    assert plan_cli.main([*base, "--device-memory", "1KiB"]) == 2
    out, err = capsys.readouterr()
    assert "\nverdict: 0 of 2 compiled candidates fit --device-memory 1KiB\n" in out
    assert err.endswith("error: --device-memory: no candidate fits 1KiB per device on 2 devices, as configured or "
                        "with a remat or offload layout; see OVER above\n")
