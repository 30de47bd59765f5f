"""One-device CPU programs run inline on the dispatching thread (jaxtrain.runtime.cpu_dispatch)."""
import os
import subprocess
import sys
import textwrap

import pytest

# A fresh JAX (the option is read when the CPU client is created): a ~0.2 s program, then whether
# its result was ready the moment the call returned.
PROBE = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jaxtrain.kernels.cpu import dispatch as cpu_dispatch
    print("inline" if cpu_dispatch.run_inline() else "default")
    work = jax.jit(lambda x: jax.lax.fori_loop(0, 12, lambda i, y: jnp.tanh(y @ x), x))
    x = jnp.full((1024, 1024), 1e-3, jnp.float32)
    work(x).block_until_ready()  # compiled, and x on the device
    print("ready" if work(x).is_ready() else "running")
""")


@pytest.mark.parametrize("opt_out,expected", [("", ["inline", "ready"]), ("0", ["inline", "ready"]),
                                              ("1", ["default", "running"])])
def test_a_program_has_finished_when_its_call_returns_unless_opted_out(opt_out, expected):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    env["JAXTRAIN_CPU_ASYNC_DISPATCH"] = opt_out
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == expected


def test_another_value_of_the_variable_is_bad_input_named_by_it():
    from jaxtrain.errors import InputError
    from jaxtrain.kernels.cpu import dispatch as cpu_dispatch
    with pytest.raises(InputError) as e:
        cpu_dispatch.run_inline({"JAXTRAIN_CPU_ASYNC_DISPATCH": "yes"})
    assert str(e.value) == ("JAXTRAIN_CPU_ASYNC_DISPATCH='yes': expected 1 (JAX's asynchronous CPU dispatch) or 0 "
                            "(inline, the default for a single-process run)")
    assert e.value.exit_code == 2
