"""run.reuse_host_memory: a large freed buffer is reused without faulting its pages in again."""
import os
import subprocess
import sys

import pytest

# Allocates, touches and frees 64 MiB twice; prints the minor page faults of the second round.
PROBE = """
import ctypes, resource, sys
from jaxtrain.runtime import host_memory
print("kept" if sys.argv[1] == "on" and host_memory.reuse_freed_memory() else "set" if sys.argv[1] == "on" else "off")
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
n = 64 << 20
def touch():
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def probe(mode: str, **env) -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env}, check=True)
    reason, faults = done.stdout.split()
    return reason, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_buffer_is_reused_without_page_faults():
    pages = (64 << 20) // 4096
    reason, faults = probe("on")
    assert reason == "set" and faults < pages // 20
    # glibc's defaults: the buffer is unmapped on free, and every page faults in again
    assert probe("off")[1] > pages // 2
    # thresholds the user set are theirs
    reason, faults = probe("on", MALLOC_TRIM_THRESHOLD_="131072")
    assert reason == "kept" and faults > pages // 2
