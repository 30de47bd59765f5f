"""jaxtrain's default XLA GPU and CPU flags: every name is one the installed jaxlib parses (XLA aborts the process
on an unknown flag, and its CPU build parses the GPU flags too), a flag the user set keeps the user's
value, the GPU ones only where a CUDA backend will start, and none with the opt-out. The CPU default
does what it is for: a dot compiles to no YNNPACK fusion."""
import subprocess
import sys

import pytest

from jaxtrain.errors import InputError
from jaxtrain.runtime import xla_flags


def run_with(flags: str, code: str = "import jax.numpy as jnp; print(float(jnp.arange(4.0).sum()))"
             ) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_every_default_flag_is_one_this_jaxlib_parses():
    ok = run_with(xla_flags.with_gpu_flags(""))
    assert ok.returncode == 0 and ok.stdout.strip() == "6.0", ok.stderr[-2000:]
    bad = run_with("--xla_gpu_no_such_flag=true")  # the check can fail: XLA rejects a name it does not know
    assert bad.returncode != 0 and "Unknown flag in XLA_FLAGS: --xla_gpu_no_such_flag" in bad.stderr


def test_the_users_flags_win_and_each_default_appears_once():
    user = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_force_host_platform_device_count=8"
    out = xla_flags.with_gpu_flags(user)
    assert out.startswith(user + " ")
    assert out.count("xla_gpu_enable_latency_hiding_scheduler") == 1
    assert out.split()[2:] == [f"--{k}={v}" for k, v in xla_flags.GPU_FLAGS.items()
                               if k != "xla_gpu_enable_latency_hiding_scheduler"]
    assert xla_flags.with_gpu_flags(out) == out


def test_added_only_where_a_cuda_backend_will_start(monkeypatch):
    present = {"jax_cuda12_plugin"}
    monkeypatch.setattr(xla_flags.importlib.util, "find_spec", lambda name: object() if name in present else None)
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert xla_flags.apply_gpu_defaults(env) is True
    assert env["XLA_FLAGS"] == xla_flags.with_gpu_flags("--xla_dump_to=/tmp/x")
    for off in ({"JAX_PLATFORMS": "cpu"}, {"JAXTRAIN_XLA_GPU_FLAGS": "0"}):
        env = {"XLA_FLAGS": "", **off}
        assert xla_flags.apply_gpu_defaults(env) is False and env["XLA_FLAGS"] == ""
    env = {"JAX_PLATFORMS": "cuda,cpu"}
    assert xla_flags.apply_gpu_defaults(env) is True and "latency_hiding" in env["XLA_FLAGS"]
    present.clear()  # no CUDA plugin installed: a CPU-only machine gets nothing
    env = {}
    assert xla_flags.apply_gpu_defaults(env) is False and env == {}


def test_the_cpu_defaults_parse_and_are_added_on_any_machine_unless_opted_out():
    ok = run_with(xla_flags.with_defaults("", xla_flags.CPU_FLAGS))
    assert ok.returncode == 0 and ok.stdout.strip() == "6.0", ok.stderr[-2000:]
    env = {}
    assert xla_flags.apply_cpu_defaults(env) is True
    assert env["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type="
    env = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=individual_dot"}  # the user's value stays
    assert xla_flags.apply_cpu_defaults(env) is True
    assert env["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type=individual_dot"
    env = {"JAXTRAIN_XLA_CPU_FLAGS": "0"}
    assert xla_flags.apply_cpu_defaults(env) is False and env == {"JAXTRAIN_XLA_CPU_FLAGS": "0"}


def test_with_the_cpu_defaults_a_dot_compiles_to_no_ynnpack_fusion():
    code = ("import jax, jax.numpy as jnp\n"
            "f = jax.jit(lambda a, b: jnp.tanh(a @ b))\n"
            "print('ynn_fusion' in f.lower(jnp.ones((256, 128)), jnp.ones((128, 64))).compile().as_text())")
    default = run_with("", code)  # this jaxlib's own default sends the dot to YNNPACK: the check can fail
    assert default.returncode == 0 and default.stdout.strip() == "True", default.stderr[-2000:]
    ours = run_with(xla_flags.with_defaults("", xla_flags.CPU_FLAGS), code)
    assert ours.returncode == 0 and ours.stdout.strip() == "False", ours.stderr[-2000:]


@pytest.mark.parametrize("name, apply", [("JAXTRAIN_XLA_CPU_FLAGS", xla_flags.apply_cpu_defaults),
                                         ("JAXTRAIN_XLA_GPU_FLAGS", xla_flags.apply_gpu_defaults)])
def test_an_opt_out_other_than_0_or_1_is_bad_input_and_empty_is_unset(name, apply):
    for value in ("false", "no", "2"):
        env = {name: value}
        with pytest.raises(InputError) as err:
            apply(env)
        assert str(err.value) == (f"{name}={value!r}: expected 1 (add jaxtrain's default XLA flags, the default) "
                                  f"or 0 (add none)")
        assert env == {name: value}  # nothing added
    assert xla_flags.apply_cpu_defaults({"JAXTRAIN_XLA_CPU_FLAGS": ""}) is True
    assert xla_flags.apply_cpu_defaults({"JAXTRAIN_XLA_CPU_FLAGS": "1"}) is True


def test_a_flag_file_is_left_to_xla_and_only_flag_names_count_as_set(tmp_path):
    flag_file = tmp_path / "flags"
    flag_file.write_text("--xla_force_host_platform_device_count=2\n")
    env = {"XLA_FLAGS": str(flag_file)}  # not starting with --: XLA reads the file
    assert xla_flags.apply_cpu_defaults(env) is False and env == {"XLA_FLAGS": str(flag_file)}
    code = "import jax; print(jax.device_count())"
    done = run_with(str(flag_file), code)
    assert done.returncode == 0 and done.stdout.strip() == "2", done.stderr[-2000:]
    inside_a_value = "--xla_dump_to=/tmp/--xla_cpu_experimental_ynn_fusion_type"
    assert xla_flags.with_defaults(inside_a_value, xla_flags.CPU_FLAGS) == (
        inside_a_value + " --xla_cpu_experimental_ynn_fusion_type=")
