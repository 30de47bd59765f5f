"""The fused XLA:CPU attention kernel (jaxtrain/kernels/cpu/library.py, cpu/attention.cc): values and
gradients against the jnp reference, results that do not depend on the rest of the batch, when
``auto`` picks it, and what happens without a C++ compiler."""
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xla_test_flags
from attention_helpers import assert_matches_reference, inputs
from jax.sharding import AxisType, Mesh

from jaxtrain.config import MESH_AXES
from jaxtrain.errors import AttentionBackendError
from jaxtrain.kernels import ops, registry
from jaxtrain.kernels.cpu import attention as cpu_attention
from jaxtrain.kernels.cpu import library as cpu_fused
from jaxtrain.models import attention as attn
from jaxtrain.parallel.activations import activation_sharding
from jaxtrain.parallel.rules import Rules

pytestmark = pytest.mark.kernels  # needs the C++ compiler (tests/conftest.py skips them without)


def fused(q, k, v, qseg=None, kvseg=None, causal=True):
    assert qseg is None and causal
    return cpu_attention.fused_attention(q, k, v)


@pytest.mark.parametrize("b,t,h,kvh,d", [
    (2, 64, 4, 4, 32),    # the shakespeare recipe's attention (batch cut down)
    (2, 48, 8, 2, 16),    # grouped-query, a length that is not a multiple of 32
    (1, 128, 2, 1, 64),   # multi-query, several 32-row blocks of keys
    (1, 16, 1, 1, 128),
])
def test_values_and_gradients_match_the_reference(b, t, h, kvh, d):
    q, k, v, do = inputs(b, t, t, h, kvh, d)
    assert_matches_reference(fused, q, k, v, do, causal=True)


def test_bfloat16_inputs_are_computed_in_float32_and_returned_in_bfloat16():
    q, k, v, do = inputs(2, 32, 32, 4, 2, 32, jnp.bfloat16)
    assert cpu_attention.fused_attention(q, k, v).dtype == jnp.bfloat16
    assert_matches_reference(fused, q, k, v, do, causal=True)


def test_a_batch_row_is_the_same_bit_for_bit_alone_or_among_others():
    # Grouped evaluation stacks batches side by side and promises each the loss it gets alone.
    q, k, v, do = inputs(3, 64, 64, 4, 2, 32)
    grads = jax.jit(jax.value_and_grad(lambda q, k, v, do: jnp.sum(cpu_attention.fused_attention(q, k, v) * do),
                                       argnums=(0, 1, 2)))
    out = jax.jit(cpu_attention.fused_attention)
    np.testing.assert_array_equal(np.asarray(out(q, k, v))[1], np.asarray(out(q[1:2], k[1:2], v[1:2]))[0])
    _, among = grads(q, k, v, do)
    _, alone = grads(q[1:2], k[1:2], v[1:2], do[1:2])
    for name, a, b in zip(("dq", "dk", "dv"), among, alone):
        np.testing.assert_array_equal(np.asarray(a)[1], np.asarray(b)[0], err_msg=name)


def on_mesh(devices: int):
    """The trainer's context while it traces: data parallelism over ``devices`` CPU devices."""
    mesh = Mesh(np.asarray(jax.devices()[:devices]).reshape(devices, 1, 1, 1, 1, 1), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))
    table = {"batch": [("data",)], **{name: [None] for name in ("length", "heads", "kv_heads", "kv")}}
    return activation_sharding(Rules("dp", table), mesh)


def choose(implementation, q, k, segment_ids=None, window=None):
    return ops.pick("attention", implementation, ops.AttentionCall(q, k, segment_ids, window, True)).name


def test_auto_picks_the_kernel_on_cpu_where_it_applies_and_says_why_not_elsewhere():
    fits = jnp.zeros((2, 64, 4, 32))
    kernel = registry.lookup("attention", "cpu_fused", "cpu")
    with on_mesh(1):
        assert choose("auto", fits, fits) == "cpu_fused"
        assert choose("auto", fits, fits, jnp.zeros((2, 64), jnp.int32)) == "blockwise"
        assert choose("auto", fits, fits, window=8) == "blockwise"
        odd = jnp.zeros((2, 40, 4, 32))
        assert choose("auto", odd, odd) == "blockwise"
        facts = ops.call_facts("attention")
        assert kernel.refuses(ops.AttentionCall(odd, odd, None, None, True), True, facts) == (
            "length 40 is not a multiple of 16")
        assert kernel.refuses(ops.AttentionCall(fits, fits, None, 8, True), True, facts) == (
            "segment ids (packed or padded documents) or a sliding window")
    with on_mesh(2):
        assert choose("auto", fits, fits) == "blockwise"
    assert jax.device_count() > 1 and choose("auto", fits, fits) == "blockwise"  # outside the trainer: 8 devices
    here = registry.choose("attention", "auto", registry.Facts("cpu", devices=jax.device_count()))
    assert here.line() == (f"model.attention=auto -> blockwise (cpu_fused: runs on one device, here "
                           f"{jax.device_count()}; causal self-attention by query blocks)")
    one = registry.choose("attention", "auto", registry.Facts("cpu", devices=1))
    assert one.line() == ("model.attention=auto -> cpu_fused (one fused kernel per (batch, kv head), the rotary "
                          "embedding inside)")


def test_explicit_choice_on_shapes_it_cannot_take_is_a_named_error():
    q = jnp.zeros((1, 40, 2, 32))
    with on_mesh(1), pytest.raises(AttentionBackendError) as e:
        attn.attention(q, q, q, implementation="cpu_fused")
    assert str(e.value) == ("model.attention=cpu_fused cannot run here: length 40 is not a multiple of 16 "
                            "(use auto or blockwise)")
    with pytest.raises(AttentionBackendError) as e:
        registry.check("attention", "cpu_fused", registry.Facts("gpu"))
    assert str(e.value) == ("model.attention: cpu_fused runs on cpu; the backend is 'gpu' "
                            "(use auto, xla, blockwise, cudnn, ring or pallas)")


def test_without_a_compiler_auto_falls_back_to_blockwise_and_the_explicit_choice_says_why(tmp_path):
    # A fresh process: the kernel is built (or not) once per process.
    code = textwrap.dedent("""
        import jax.numpy as jnp
        from jaxtrain.errors import AttentionBackendError
        from jaxtrain.kernels import ops
        q = jnp.zeros((1, 64, 2, 32))
        print(ops.pick("attention", "auto", ops.AttentionCall(q, q, None, None, True)).name)
        try:
            ops.attention(q, q, q, implementation="cpu_fused")
        except AttentionBackendError as err:
            print(err)
    """)
    env = {"PATH": "/usr/bin:/bin", "CXX": "no-such-compiler", "JAXTRAIN_KERNEL_CACHE_DIR": str(tmp_path),
           "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "blockwise",
        "model.attention=cpu_fused cannot run here: no C++ compiler: 'no-such-compiler' cannot be run (set CXX to "
        "one) (use auto or blockwise)"]
    assert not list(tmp_path.glob("*.so"))


def test_a_failed_build_is_reported_and_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_KERNEL_CACHE_DIR", str(tmp_path))
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_fused, "SOURCES", (broken,))
    with pytest.raises(RuntimeError, match=r"c\+\+ failed \(1\): .*broken.cc"):
        cpu_fused._build(["c++"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.cc"]  # no library, no temporary


@pytest.mark.slow  # over ~20 s on 2 cores (CI's durations)
def test_the_library_is_built_once_and_named_by_what_it_was_built_from(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_KERNEL_CACHE_DIR", str(tmp_path))
    first = cpu_fused._build(["c++"])
    stamp = first.stat().st_mtime_ns
    assert cpu_fused._build(["c++"]) == first and first.stat().st_mtime_ns == stamp  # cached
    assert cpu_fused._library(["c++", "-O0"]) != first  # flags given in $CXX
    for i, source in enumerate(cpu_fused.SOURCES):  # each source, and the header they share
        changed = tmp_path / source.name
        changed.write_text(source.read_text() + "\n// another revision\n")
        monkeypatch.setattr(cpu_fused, "SOURCES", (*cpu_fused.SOURCES[:i], changed, *cpu_fused.SOURCES[i + 1:]))
        assert cpu_fused._library(["c++"]) != first
        monkeypatch.undo()
        monkeypatch.setenv("JAXTRAIN_KERNEL_CACHE_DIR", str(tmp_path))
    header = tmp_path / "cpu_parallel.h"
    header.write_text(cpu_fused.HEADERS[0].read_text() + "\n// another revision\n")
    monkeypatch.setattr(cpu_fused, "HEADERS", (header,))
    assert cpu_fused._library(["c++"]) != first


def test_a_new_process_loading_a_cached_program_registers_the_kernel_first(tmp_path, corpus_path):
    """The program cache keeps the traced train step; a later process loads it without tracing the
    model, so nothing else would have registered the kernel's custom calls before XLA compiles it."""
    env = {**os.environ, "JAXTRAIN_PROGRAM_CACHE_DIR": str(tmp_path / "programs"), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_test_flags.with_devices(1)}
    env.pop("JAXTRAIN_PROGRAM_CACHE", None)
    runs = []
    for name in ("cold", "warm"):
        done = subprocess.run([sys.executable, "-m", "jaxtrain.train", "--config", "configs/shakespeare_char.yaml",
                               f"data.path={corpus_path}", f"run.dir={tmp_path / name}", "train.steps=3",
                               "train.log_every=1", "train.eval_batches=1", "train.sample_tokens=0",
                               "run.progress=false"], capture_output=True, text=True, env=env, timeout=600,
                              cwd=Path(__file__).resolve().parents[2])
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(done.stdout + done.stderr)
    assert ("model.attention=auto -> cpu_fused (one fused kernel per (batch, kv head), the rotary embedding "
            "inside)") in runs[0]
    assert "read from the program cache" not in runs[0]
    assert "compiled train step in" in runs[1] and "(its traced program read from the program cache)" in runs[1]
    losses = [[json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
               if '"loss"' in line] for name in ("cold", "warm")]
    assert len(losses[0]) == 3 and losses[0] == losses[1]


@pytest.mark.slow  # over ~20 s on 2 cores (CI's durations)
def test_a_warm_starts_prefetch_registers_a_library_already_built_and_builds_none(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_KERNEL_CACHE_DIR", str(tmp_path))
    registered = []
    monkeypatch.setattr(cpu_fused, "problem", lambda: registered.append(True))
    cpu_fused.register_if_built()
    assert registered == [] and not list(tmp_path.iterdir())
    cpu_fused._build(["c++"])
    cpu_fused.register_if_built()
    assert registered == [True]


def test_a_compiler_that_writes_nothing_or_a_damaged_library_is_reported_and_not_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_KERNEL_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="true exited 0 but wrote no library"):
        cpu_fused._build(["true"])
    assert not list(tmp_path.iterdir())
    damaged = cpu_fused._library(["c++"])
    damaged.write_bytes(b"not a shared library")
    monkeypatch.setitem(cpu_fused._state, "done", False)  # as in a new process; both restored afterwards
    monkeypatch.setitem(cpu_fused._state, "problem", None)
    monkeypatch.setenv("CXX", "c++")
    why = cpu_fused.problem()
    assert why.startswith("the kernel did not build: ") and not damaged.exists()


@pytest.mark.parametrize("overrides, message", [
    (["data.seq_len=50"], "length 50 (data.seq_len) is not a multiple of 16 up to 1024"),
    (["model.d_model=96"], "head_dim 24 (model.d_model / model.n_heads) is not a multiple of 16"),
    (["data.mode=packed"], "segment ids (packed or padded documents: data.mode)"),
])
def test_an_explicit_choice_the_config_cannot_give_is_named_before_anything_is_built(small_cfg, overrides, message):
    from jaxtrain.config import check_against_mesh
    from jaxtrain.errors import ConfigError
    one = {a: 1 for a in MESH_AXES}
    with pytest.raises(ConfigError) as e:
        check_against_mesh(small_cfg("model.attention=cpu_fused", *overrides), one, "cpu")
    assert str(e.value) == f"model.attention=cpu_fused cannot run here: {message} (use auto or blockwise)"
    with pytest.raises(ConfigError) as e:
        check_against_mesh(small_cfg("model.attention=cpu_fused"), {**one, "data": 2}, "cpu")
    assert str(e.value) == ("model.attention=cpu_fused cannot run here: runs on one device, here 2 "
                            "(use auto or blockwise)")


@pytest.mark.slow  # over ~20 s on 2 cores (CI's durations)
def test_a_stale_temporary_from_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_KERNEL_CACHE_DIR", str(tmp_path))
    stale, fresh = tmp_path / "a.so.tmp", tmp_path / "b.so.tmp"
    stale.write_bytes(b"x"), fresh.write_bytes(b"y")
    old = stale.stat().st_mtime - cpu_fused.STALE_S - 60
    os.utime(stale, (old, old))
    cpu_fused._build(["c++"])
    assert not stale.exists() and fresh.exists()  # another process's build may be writing it


def test_an_installed_package_carries_every_kernel_source_and_header():
    """pyproject's package data for jaxtrain.kernels.cpu covers each file the build compiles or includes (a
    wheel without cpu_parallel.h could not build the kernels)."""
    import fnmatch
    import tomllib
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["jaxtrain.kernels.cpu"]
    missing = [p.name for p in (*cpu_fused.SOURCES, *cpu_fused.HEADERS)
               if not any(fnmatch.fnmatch(p.name, g) for g in globs)]
    assert missing == []
    included = {name for path in cpu_fused.SOURCES + cpu_fused.HEADERS
                for name in re.findall(r'#include "([^"/]+)"', path.read_text())}
    assert included <= {p.name for p in cpu_fused.HEADERS}  # every local header is in the build's digest
