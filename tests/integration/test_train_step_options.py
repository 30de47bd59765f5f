"""The train step's own XLA compiler options (jaxtrain.runtime.xla_flags.train_step_options): on an AMD
or Intel CPU its reductions go to YNNPACK, unless the user's XLA_FLAGS names that option; the evaluation keeps
XLA's own reductions; the program cache compiles the exported step with the same options."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxtrain.kernels.cpu import program_cache
from jaxtrain.runtime import xla_flags
from jaxtrain.train import fit
from jaxtrain.train.assembly import setup

YNN = "xla_cpu_experimental_ynn_fusion_type"
ONE = {YNN: "LIBRARY_FUSION_TYPE_REDUCE"}


def test_the_options_follow_the_vendor_the_platform_and_the_users_flags(tmp_path):
    ours = {}
    assert xla_flags.apply_cpu_defaults(ours) is True  # the trainer's start: its own default, marked as its own
    assert ours[xla_flags.ADDED] == YNN
    assert xla_flags.train_step_options("cpu", ours, vendor="AuthenticAMD") == ONE == xla_flags.TRAIN_STEP_OPTIONS
    assert xla_flags.train_step_options("cpu", ours, vendor="GenuineIntel") == ONE
    assert xla_flags.train_step_options("cpu", ours, vendor="HygonGenuine") == {}  # not measured there
    assert xla_flags.train_step_options("cpu", ours, vendor="") == {}
    assert xla_flags.train_step_options("gpu", ours, vendor="AuthenticAMD") == {}
    assert xla_flags.train_step_options("cpu", ours, vendor="AuthenticAMD", processes=2) == {}
    child = dict(ours)  # a process the trainer starts inherits both variables: still jaxtrain's default
    xla_flags.apply_cpu_defaults(child)
    assert child == ours and xla_flags.train_step_options("cpu", child, vendor="AuthenticAMD") == ONE
    users = {"XLA_FLAGS": f"--{YNN}="}  # the same value, set by the user: it holds for every program
    xla_flags.apply_cpu_defaults(users)
    assert xla_flags.ADDED not in users and xla_flags.users_flags(users) == {YNN}
    assert xla_flags.train_step_options("cpu", users, vendor="AuthenticAMD") == {}
    changed = {**ours, "XLA_FLAGS": f"--{YNN}=individual_dot"}  # marked as jaxtrain's, but not its value
    assert xla_flags.train_step_options("cpu", changed, vendor="AuthenticAMD") == {}
    other = {**ours, "XLA_FLAGS": ours["XLA_FLAGS"] + " --xla_force_host_platform_device_count=8"}
    assert xla_flags.users_flags(other) == {"xla_force_host_platform_device_count"}
    assert xla_flags.train_step_options("cpu", other, vendor="AuthenticAMD") == ONE
    assert xla_flags.train_step_options("cpu", {**ours, "JAXTRAIN_XLA_CPU_FLAGS": "0"}, vendor="AuthenticAMD") == {}
    flag_file = tmp_path / "flags"
    flag_file.write_text("--xla_force_host_platform_device_count=2\n")
    assert xla_flags.train_step_options("cpu", {"XLA_FLAGS": str(flag_file)}, vendor="AuthenticAMD") == {}
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
    assert xla_flags.cpu_vendor(str(cpuinfo)) == "AuthenticAMD"
    assert xla_flags.cpu_vendor(str(tmp_path / "none")) == ""


@pytest.fixture
def vendor(monkeypatch):
    """vendor('AuthenticAMD'): this process as a trainer on such a CPU. The test process's XLA_FLAGS name
    the option (tests/helpers/xla_test_flags.py) with jaxtrain's default value: marked as jaxtrain's own."""
    monkeypatch.setenv(xla_flags.ADDED, YNN)
    return lambda name: monkeypatch.setattr(xla_flags, "cpu_vendor", lambda *a: name)


def _ynn(compiled) -> int:
    return compiled.as_text().count('"kind":"__ynn_fusion"')


def test_on_amd_and_intel_the_train_step_alone_sends_its_reductions_to_ynnpack(small_cfg, vendor):
    vendor("AuthenticAMD")
    s = setup(small_cfg("mesh.data=1"), jax.devices()[:1], vocab=256)
    assert s.fns.train_step_options == ONE
    state, batch = s.abstract_state(), s.abstract_batch()
    assert _ynn(s.fns.train_step.lower(state, batch).compile()) > 0
    val = {k: jax.ShapeDtypeStruct((4, *v.shape[1:]), v.dtype, sharding=s.fns.batch_sharding) for k, v in batch.items()}
    assert _ynn(s.fns.evaluate.lower(state["params"], val).compile()) == 0
    vendor("GenuineIntel")
    assert setup(small_cfg("mesh.data=1"), jax.devices()[:1], vocab=256).fns.train_step_options == ONE
    vendor("HygonGenuine")  # a CPU where the option was not measured
    s = setup(small_cfg("mesh.data=1"), jax.devices()[:1], vocab=256)
    assert s.fns.train_step_options == {} and _ynn(s.fns.train_step.lower(state, batch).compile()) == 0


def test_the_cached_program_has_the_options_and_the_losses_differ_only_in_the_last_bits(
        small_cfg, vendor, tmp_path, monkeypatch):
    cfg = lambda name: small_cfg("train.steps=4", "train.log_every=1", "train.eval_every=4",  # noqa: E731
                                 "mesh.data=1", "checkpoint.enabled=false", run_dir=name)
    one = jax.devices()[:1]
    vendor("")  # not Linux: no vendor, no option
    plain = fit(cfg("plain"), devices=one, quiet=True).rows
    vendor("AuthenticAMD")
    monkeypatch.setenv(program_cache.DIR_VAR, str(tmp_path / "programs"))
    monkeypatch.delenv(program_cache.SWITCH, raising=False)
    assert program_cache.enable()
    try:
        s = setup(cfg("setup"), one, vocab=256)
        step = program_cache.train_step(s, s.abstract_state(), s.abstract_batch())
        assert step is not None and _ynn(step) > 0
        amd = fit(cfg("amd"), devices=one, quiet=True).rows
    finally:
        program_cache.disable()
    key = ("loss", "grad_norm", "val_loss")
    a = np.array([[r[k] for k in key if k in r] for r in plain if "loss" in r], dtype=np.float64)
    b = np.array([[r[k] for k in key if k in r] for r in amd if "loss" in r], dtype=np.float64)
    assert a.shape == b.shape == (4, 2)
    np.testing.assert_allclose(b, a, rtol=1e-5)
    vals = [[r["val_loss"] for r in rows if "val_loss" in r] for rows in (plain, amd)]
    assert len(vals[0]) == 1 and abs(vals[1][0] - vals[0][0]) < 1e-4
