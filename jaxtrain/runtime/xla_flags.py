"""XLA flags added before JAX starts: GPU performance flags where this process will run on an NVIDIA
GPU, and one CPU flag everywhere (below); and the train step's own compiler options on an AMD or
Intel CPU.

XLA keeps collectives and compute in program order unless told otherwise; the flags below let it
overlap them, the same set MaxText's GPU recipes and NVIDIA's JAX-Toolbox performance guide set
for FSDP-style training (``xla/debug_options_flags.cc`` documents each):

* ``xla_gpu_enable_latency_hiding_scheduler``: schedule asynchronous collectives to overlap compute;
* ``xla_gpu_enable_pipelined_{all_gather,reduce_scatter,all_reduce}``: start the next layer's
  all-gather (and finish the previous one's reduce-scatter) inside the scanned layer loop;
* ``xla_gpu_enable_while_loop_double_buffering``: unroll the scan by two so that pipelining has room;
* ``xla_gpu_*_combine_threshold_bytes``: combine small collectives into large ones (1 GiB for
  all-reduce; all-gather and reduce-scatter at 1/8 and 1/16 of it: MaxText's values for 8 GPUs a node).

:func:`apply_gpu_defaults` adds the flags to ``XLA_FLAGS`` before JAX starts its backend (XLA reads
the variable once, then) when a CUDA plugin is installed and ``JAX_PLATFORMS`` does not exclude it.
A flag the user already set keeps the user's value; ``JAXTRAIN_XLA_GPU_FLAGS=0`` adds none (the A/B
of ``benchmarks/gpu_h200.sh``). XLA aborts the process on a flag it does not know, so the names are
checked against the installed jaxlib in tests/unit/test_xla_flags.py (its CPU build parses the GPU
flags too).

On every machine :func:`apply_cpu_defaults` adds :data:`CPU_FLAGS` the same way (opt-out
``JAXTRAIN_XLA_CPU_FLAGS=0``): ``xla_cpu_experimental_ynn_fusion_type=`` (empty: no op goes to
YNNPACK; its dots go to XLA's own kernels). Each YNNPACK fusion builds its plan the first time a
program runs (measured with ``perf``: ~0.2 s of a one-step shakespeare run, in its first step and
first evaluation), and the steady step was the same either way: on a 2-core AMD EPYC, 5 alternated
rounds of 200 steps, median 37.9 ms with YNNPACK against 38.4 ms without; the 25M step 2472 against
2432 ms (3 rounds); on an Intel Xeon (AVX-512, AMX) no change beyond the noise. The one-step run
took a median 3.87 s with it against 3.55 s without (10 alternated rounds, AMD EPYC). Float results
differ from YNNPACK's in the last bits.

The train step alone, on an AMD or Intel CPU (``vendor_id`` AuthenticAMD or GenuineIntel), compiles
with the option ``xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_REDUCE``
(:func:`train_step_options`): XLA's reductions (RMSNorm's mean of squares, the softmax's max and sum,
the norm-scale gradients, the gradient norm) go to YNNPACK, nothing else does. XLA:CPU splits each
of them into a ``reduce-window`` and a ``reduce`` of its own, and those ran ~1.7 ms of a ~25 ms
shakespeare-char step (XLA profile, Intel Xeon). Measured, the step's time with it against without:
on a 2-core AMD EPYC (family 25 model 17) 0.92-0.96x (paired medians of in-process rounds, the same
lowered program compiled both ways), the 8-device one (``mesh.data=4 mesh.tensor=2``) 0.97x, the
25M and 8-expert MoE steps 0.99x and 1.00x; on a 2-core Intel Xeon (family 6 model 167, AVX-512,
AMX) 0.88-0.96x, every one of 5 alternated command-line rounds of 300 steps faster (median step
23.8 against 26.2 ms). It is an option of that one program, not a flag: the evaluation programs
keep XLA's own reductions, because YNNPACK sums in another order when a batch dimension is added,
and the grouped evaluation promises each batch the loss it gets alone, bit for bit. Not set for a
run of several processes, where the user's ``XLA_FLAGS`` names the flag (:func:`users_flags`; the
user's value then holds for every program) or names a flag file, with ``JAXTRAIN_XLA_CPU_FLAGS=0``,
or on another CPU, where it is not measured. The train step's float sums differ from those
without it in the last bits.
"""
from __future__ import annotations

import importlib.util
import os
import re

from jaxtrain.runtime.env import switch

GPU_FLAGS = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    "xla_gpu_enable_while_loop_double_buffering": "true",
    "xla_gpu_all_reduce_combine_threshold_bytes": str(1 << 30),
    "xla_gpu_all_gather_combine_threshold_bytes": str(1 << 27),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(1 << 26),
}
CPU_FLAGS = {"xla_cpu_experimental_ynn_fusion_type": ""}
TRAIN_STEP_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}  # see above
AMD, INTEL = "AuthenticAMD", "GenuineIntel"
TRAIN_STEP_VENDORS = (AMD, INTEL)  # where TRAIN_STEP_OPTIONS was measured faster
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")
OPT_OUT = "JAXTRAIN_XLA_GPU_FLAGS"
CPU_OPT_OUT = "JAXTRAIN_XLA_CPU_FLAGS"
ADDED = "JAXTRAIN_XLA_FLAGS_ADDED"  # the names of the XLA_FLAGS entries jaxtrain added, comma-separated


def gpu_expected(env: os._Environ | dict = os.environ) -> bool:
    """Whether this process will start a CUDA backend: a CUDA plugin is installed and ``JAX_PLATFORMS``
    (when set) names ``cuda`` or ``gpu``."""
    platforms = env.get("JAX_PLATFORMS", "").lower()
    if platforms and not re.search(r"\b(cuda|gpu)\b", platforms):
        return False
    return any(importlib.util.find_spec(p) is not None for p in CUDA_PLUGINS)


def is_flag_file(xla_flags: str) -> bool:
    """Whether XLA reads this ``XLA_FLAGS`` value as the path of a file of flags (it does not start with ``--``)."""
    return bool(xla_flags.strip()) and not xla_flags.strip().startswith("--")


def _values(xla_flags: str) -> dict[str, str]:
    """``{name: value}`` of the flags an ``XLA_FLAGS`` value sets (names, not text inside a value)."""
    return dict(re.findall(r"(?:^|\s)--(\w+)=?(\S*)", xla_flags))


def _added(env: os._Environ | dict) -> set[str]:
    """The names in ``env[ADDED]``."""
    return set(filter(None, env.get(ADDED, "").split(",")))


def with_defaults(xla_flags: str, defaults: dict[str, str]) -> str:
    """``xla_flags`` (an ``XLA_FLAGS`` value) plus every ``defaults`` entry it does not set already.

    A value that does not start with ``--`` is the path of a file of flags to XLA: it is returned as
    it is (an appended flag would become part of the file's name)."""
    if is_flag_file(xla_flags):
        return xla_flags
    given = _values(xla_flags)
    added = [f"--{name}={value}" for name, value in defaults.items() if name not in given]
    return " ".join([xla_flags.strip(), *added]).strip()


def with_gpu_flags(xla_flags: str) -> str:
    """``xla_flags`` plus every :data:`GPU_FLAGS` entry it does not set already."""
    return with_defaults(xla_flags, GPU_FLAGS)


def _wanted(env: os._Environ | dict, name: str) -> bool:
    """Whether the opt-out variable ``name`` leaves the defaults on: ``1`` or unset (or empty), ``0`` off.

    Raises:
      InputError: any other value (e.g. ``false``, which would otherwise read as on).
    """
    return switch(name, True, "add jaxtrain's default XLA flags, the default", "add none", env)


def apply_gpu_defaults(env: os._Environ | dict = os.environ) -> bool:
    """Adds :data:`GPU_FLAGS` to ``env['XLA_FLAGS']`` when a GPU is expected and the user did not opt out
    (``JAXTRAIN_XLA_GPU_FLAGS=0``), unless ``XLA_FLAGS`` names a flag file. Call before anything starts
    JAX's backend. Returns whether it did.

    Raises:
      InputError: ``JAXTRAIN_XLA_GPU_FLAGS`` is neither ``0`` nor ``1``.
    """
    if not _wanted(env, OPT_OUT) or not gpu_expected(env):
        return False
    return _update(env, GPU_FLAGS)


def apply_cpu_defaults(env: os._Environ | dict = os.environ) -> bool:
    """Adds :data:`CPU_FLAGS` to ``env['XLA_FLAGS']`` unless the user opted out (``JAXTRAIN_XLA_CPU_FLAGS=0``)
    or ``XLA_FLAGS`` names a flag file; a flag already set keeps its value. Call before anything starts
    JAX's backend. Returns whether it did.

    Raises:
      InputError: ``JAXTRAIN_XLA_CPU_FLAGS`` is neither ``0`` nor ``1``.
    """
    if not _wanted(env, CPU_OPT_OUT):
        return False
    return _update(env, CPU_FLAGS)


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's ``vendor_id`` (``AuthenticAMD``, ``GenuineIntel``) from ``cpuinfo``; ``""`` where that
    file is missing or names none (not Linux)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def train_step_options(platform: str, env: os._Environ | dict = os.environ,
                       vendor: str | None = None, processes: int = 1) -> dict[str, str]:
    """The XLA compiler options of the train step alone (``jax.jit(..., compiler_options=...)``) on
    devices of ``platform`` (``cpu``, ``gpu``, ``tpu``): :data:`TRAIN_STEP_OPTIONS` on an AMD or
    Intel CPU (``vendor``; None: this machine's, :func:`cpu_vendor`), less every option the user's
    ``XLA_FLAGS`` names (:func:`users_flags`); nothing where ``XLA_FLAGS`` names a flag file or
    ``JAXTRAIN_XLA_CPU_FLAGS=0`` (see the module docstring), nor for a run of several ``processes``
    (hosts of different CPU vendors would compile the step differently, and the state every process
    holds a replica of could drift apart in the last bits).

    Raises:
      InputError: ``JAXTRAIN_XLA_CPU_FLAGS`` is neither ``0`` nor ``1``.
    """
    if platform != "cpu" or processes > 1 or not _wanted(env, CPU_OPT_OUT):
        return {}
    given = env.get("XLA_FLAGS", "")
    if is_flag_file(given) or (cpu_vendor() if vendor is None else vendor) not in TRAIN_STEP_VENDORS:
        return {}
    return {k: v for k, v in TRAIN_STEP_OPTIONS.items() if k not in users_flags(env)}


def users_flags(env: os._Environ | dict = os.environ) -> set[str]:
    """The flag names ``env['XLA_FLAGS']`` sets, less the defaults jaxtrain added there itself
    (:data:`ADDED`, inherited by the processes a trainer starts) that still hold jaxtrain's value."""
    ours, added = {**CPU_FLAGS, **GPU_FLAGS}, _added(env)
    return {n for n, v in _values(env.get("XLA_FLAGS", "")).items() if not (n in added and ours.get(n) == v)}


def _update(env: os._Environ | dict, defaults: dict[str, str]) -> bool:
    """``env['XLA_FLAGS']`` with ``defaults`` added (:func:`with_defaults`), and their names in
    ``env[ADDED]``; whether it could be."""
    given = env.get("XLA_FLAGS", "")
    if is_flag_file(given):
        return False  # left to XLA as it is
    env["XLA_FLAGS"] = with_defaults(given, defaults)
    added = _added(env) | (set(defaults) - set(_values(given)))
    if added:
        env[ADDED] = ",".join(sorted(added))
    return True
