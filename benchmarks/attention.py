"""Attention speed (TFLOP/s) of ours (Pallas) vs cuDNN vs XLA, and ring-attention memory.

    python benchmarks/attention.py                      # GPU: seq 2k/4k/8k, head_dim 128, bf16, causal
    python benchmarks/attention.py --cpu-smoke          # tiny sizes on CPU (Pallas in interpret mode)
    python benchmarks/attention.py --cpu                # CPU: xla vs blockwise vs cpu_fused at the 25M config's shape
    python benchmarks/attention.py --ring-memory        # per-device bytes, ring vs all-gathered K/V,
                                                        # 8k tokens on 8 simulated CPU devices

FLOPs follow the FlashAttention papers' convention: forward = 4 * batch * heads * q_len *
kv_len * head_dim, halved when causal; backward = 2.5 x forward. "bwd" is timed as
(forward + backward) - forward. Times are medians of --iters runs after one warm-up.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", default="2048,4096,8192")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--impls", default="pallas,cudnn,xla")
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, f32, xla + pallas (interpret)")
    p.add_argument("--cpu", action="store_true", help="llama_25m's shape (batch 8, 8 heads of 64, seq 64/256), "
                   "f32, xla vs blockwise vs cpu_fused")
    p.add_argument("--ring-memory", action="store_true", help="compiled memory of ring vs all-gather K/V")
    p.add_argument("--ring-seq", type=int, default=8192)
    p.add_argument("--ring-devices", type=int, default=8)
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.seqs, args.batch, args.heads, args.kv_heads, args.head_dim = "128,256", 1, 2, 1, 64
        args.dtype, args.impls, args.iters = "float32", "xla,pallas", 2
    if args.cpu:
        args.seqs, args.batch, args.heads, args.kv_heads, args.head_dim = "64,256", 8, 8, 8, 64
        args.dtype, args.impls = "float32", "xla,blockwise,cpu_fused"
    return args


def attention_flops(batch, heads, q_len, kv_len, head_dim, causal):
    f = 4.0 * batch * heads * q_len * kv_len * head_dim
    return f / 2 if causal else f


def _median_time(fn, args, iters):
    import jax
    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def speed(args) -> int:
    import jax
    import jax.numpy as jnp

    from jaxtrain.models.attention import attention

    dtype = jnp.dtype(args.dtype)
    causal = not args.non_causal
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}, "
          f"batch {args.batch}, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, {args.dtype}, "
          f"{'causal' if causal else 'non-causal'}")
    print(f"{'impl':9} {'seq':>6} {'fwd ms':>9} {'fwd TF/s':>9} {'bwd ms':>9} {'bwd TF/s':>9}")
    for seq in [int(s) for s in args.seqs.split(",")]:
        key = jax.random.split(jax.random.PRNGKey(0), 4)
        q = jax.random.normal(key[0], (args.batch, seq, args.heads, args.head_dim), dtype)
        k = jax.random.normal(key[1], (args.batch, seq, args.kv_heads, args.head_dim), dtype)
        v = jax.random.normal(key[2], (args.batch, seq, args.kv_heads, args.head_dim), dtype)
        do = jax.random.normal(key[3], q.shape, dtype)
        flops = attention_flops(args.batch, args.heads, seq, seq, args.head_dim, causal)
        for impl in args.impls.split(","):
            fwd = jax.jit(lambda q, k, v, impl=impl: attention(q, k, v, implementation=impl, causal=causal))

            def fwd_bwd(q, k, v, impl=impl):
                o, vjp = jax.vjp(lambda *a: attention(*a, implementation=impl, causal=causal), q, k, v)
                return vjp(do)

            try:
                t_f = _median_time(fwd, (q, k, v), args.iters)
                t_fb = _median_time(jax.jit(fwd_bwd), (q, k, v), args.iters)
            except Exception as err:  # e.g. cudnn off a GPU, or out of memory: report, keep going
                print(f"{impl:9} {seq:>6}  unavailable: {type(err).__name__}: {str(err).splitlines()[0][:90]}")
                continue
            t_b = max(t_fb - t_f, 1e-9)
            print(f"{impl:9} {seq:>6} {t_f * 1e3:9.3f} {flops / t_f / 1e12:9.2f} {t_b * 1e3:9.3f} "
                  f"{2.5 * flops / t_b / 1e12:9.2f}", flush=True)
    return 0


def ring_memory(args) -> int:
    """Per-device compiled bytes of attention fwd+bwd with the sequence over `sequence`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtrain.config import MESH_AXES
    from jaxtrain.models.attention import attention
    from jaxtrain.parallel.activations import activation_sharding
    from jaxtrain.parallel.rules import Rules

    n, t = args.ring_devices, args.ring_seq
    b, h, kvh, d = 1, 8, 8, 128
    mesh = Mesh(np.asarray(jax.devices()[:n]).reshape(1, 1, 1, n, 1, 1), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))
    rules = Rules("sp", {"batch": [("data",)], "length": [("sequence",)], "heads": [None], "kv_heads": [None],
                         "kv": [None]})
    seq = NamedSharding(mesh, P(None, "sequence"))
    shapes = [jax.ShapeDtypeStruct((b, t, h, d), jnp.float32, sharding=seq),
              jax.ShapeDtypeStruct((b, t, kvh, d), jnp.float32, sharding=seq),
              jax.ShapeDtypeStruct((b, t, kvh, d), jnp.float32, sharding=seq)]

    def loss(impl):
        def f(q, k, v):
            with activation_sharding(rules, mesh):
                if impl != "ring":  # all-gather K/V over `sequence`, queries stay sharded
                    k = jax.lax.with_sharding_constraint(k, NamedSharding(mesh, P()))
                    v = jax.lax.with_sharding_constraint(v, NamedSharding(mesh, P()))
                o = attention(q, k, v, implementation=impl)
                return jnp.sum(jax.lax.with_sharding_constraint(o, seq) ** 2)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)), out_shardings=(seq, seq, seq))

    kv_bytes = 2 * b * t * kvh * d * 4
    print(f"ring memory: {t} tokens on {n} CPU devices (sequence={n}), batch {b}, heads {h}/{kvh}, "
          f"head_dim {d}, f32, causal, forward + backward; bytes per device from compiled.memory_analysis()")
    print(f"  K+V for the whole sequence: {kv_bytes / 2**20:.1f} MiB; one device's share: "
          f"{kv_bytes / n / 2**20:.1f} MiB")
    print(f"{'impl':28} {'temp MiB':>10} {'args MiB':>10} {'out MiB':>10}")
    for impl, label in (("ring", "ring (zig-zag, ours)"), ("xla", "all-gather K/V + XLA")):
        mem = loss(impl).lower(*shapes).compile().memory_analysis()
        print(f"{label:28} {mem.temp_size_in_bytes / 2**20:10.1f} {mem.argument_size_in_bytes / 2**20:10.1f} "
              f"{mem.output_size_in_bytes / 2**20:10.1f}", flush=True)
    return 0


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.cpu_smoke or args.cpu or args.ring_memory:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.ring_memory and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.ring_devices}").strip()
    return ring_memory(args) if args.ring_memory else speed(args)


if __name__ == "__main__":
    sys.exit(main())
