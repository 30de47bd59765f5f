"""A compiled step larger than the memory there is: a named input error (exit 2) before it runs, not
RESOURCE_EXHAUSTED and exit 1 after it was dispatched (a new user's probe: train.global_batch=100000)."""
import os

import jax
import pytest

from jaxtrain.errors import InputError
from jaxtrain.metrics import memory


def _report(peak: int):
    report = memory.MemoryReport.__new__(memory.MemoryReport)
    report.compiled = {"device_peak": peak}
    return report


def test_a_step_above_the_hosts_memory_is_refused_by_name():
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    devices = jax.devices()[:2]
    memory.check_fits(_report(total // 4), devices)  # 2 x a quarter: fits
    with pytest.raises(InputError) as err:
        memory.check_fits(_report(total), devices)
    assert str(err.value) == (
        f"train.global_batch: the compiled train step needs 2 CPU devices x {memory.fmt_bytes(total)} = "
        f"{memory.fmt_bytes(2 * total)}, more than the {memory.fmt_bytes(total)} there is; lower train.global_batch "
        f"(or raise train.grad_accum), data.seq_len or the model, or find a layout: python -m jaxtrain.plan "
        f"--device-memory")
    memory.check_fits(_report(0), devices)  # no figure from the compiler: nothing to check
