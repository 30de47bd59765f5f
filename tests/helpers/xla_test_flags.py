"""XLA flags every test process compiles with (this one, and the trainers and workers it starts).

``--xla_backend_optimization_level=0``: LLVM does not optimise XLA:CPU's generated code. The tests
compile far more than they run (small models, a few steps), and compiling is about 40% faster this
way (13 s -> 8 s for four train-step and init programs of the small model; the subset of
test_train, test_sharding_matrix and the 100-batch evaluations 181 s -> 148 s, AMD EPYC). The HLO is
the same; float results differ from the optimised build's in the last bits, so every process that a
test compares with another gets the same flags. Speed is measured in benchmarks/, never here.

The CPU defaults that ``python -m jaxtrain.train`` adds (``jaxtrain.runtime.xla_flags.CPU_FLAGS``)
are here too, for the same reason: a trainer a test starts and the test's own process compile alike.
"""
from jaxtrain.runtime.xla_flags import CPU_FLAGS

FLAGS = " ".join(["--xla_backend_optimization_level=0", *(f"--{k}={v}" for k, v in CPU_FLAGS.items())])


def with_devices(n: int) -> str:
    """An ``XLA_FLAGS`` value: ``n`` simulated CPU devices, plus :data:`FLAGS`."""
    return f"--xla_force_host_platform_device_count={n} {FLAGS}"
