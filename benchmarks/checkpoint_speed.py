"""Checkpoint speed: async-save blocking time vs step time, and save/restore MB/s (local and S3).

    python benchmarks/checkpoint_speed.py [--mb 64] [--steps 60] [--no-s3] [--data FILE]

1. Trains the shakespeare_char config (``configs/shakespeare_char.yaml``) with a
   save every 10 steps and prints the median step time next to the median time
   the loop was blocked by each async save, and each save's total time.
2. Saves and restores a synthetic sharded state of ``--mb`` MB of float32
   through :class:`jaxtrain.checkpoint.checkpointer.Checkpointer`, to local disk and, unless
   ``--no-s3``, to a local S3 server (``moto_server``, started here), and prints MB/s.
   moto keeps objects in Python memory, so its figures show our overhead, not S3's.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxtrain import config as cfglib  # noqa: E402
from jaxtrain.checkpoint import checkpointer as ckptlib  # noqa: E402
from jaxtrain.train import fit  # noqa: E402


def blocking_vs_step(data: str, steps: int, workdir: Path) -> None:
    cfg = cfglib.load("shakespeare_char", [
        f"data.path={data}", f"train.steps={steps}", "train.log_every=1", "train.eval_every=100000",
        "train.eval_batches=2", "train.sample_tokens=4", "checkpoint.every=10", "checkpoint.keep=2",
        "mesh.data=1", f"run.dir={workdir / 'shakespeare'}", "run.progress=false"])
    result = fit(cfg, devices=jax.devices()[:1], quiet=True)
    saves = [r for r in result.rows if "checkpoint_saved" in r]
    times = [r["step_time_s"] for r in result.rows if "step_time_s" in r and r["step"] > 2]
    block = [r["save_blocking_s"] for r in saves[1:]]  # the first save includes one-off set-up
    total = [r["save_total_s"] for r in saves[1:]]
    checksum = [r["checksum_s"] for r in saves[1:]]
    state_mb = sum(x.nbytes for x in jax.tree_util.tree_leaves(result.state)) / 1e6
    print(f"shakespeare_char ({state_mb:.1f} MB of state, 1 device): median step "
          f"{1e3 * statistics.median(times):.1f} ms; "
          f"async save blocks the loop for median {1e3 * statistics.median(block):.1f} ms "
          f"(first save {1e3 * saves[0]['save_blocking_s']:.0f} ms), completes in median "
          f"{1e3 * statistics.median(total):.0f} ms, of which sizes + CRC32C {1e3 * statistics.median(checksum):.1f} "
          f"ms (off the training thread); {len(saves)} saves")


def synthetic_state(mb: int):
    mesh = jax.make_mesh((len(jax.devices()),), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("fsdp"))
    n = 8
    rows = mb * 1_000_000 // 4 // n // 1024
    rows -= rows % len(jax.devices())
    make = jax.jit(lambda k: jax.random.normal(k, (rows, 1024), jnp.float32), out_shardings=sharding)
    state = {f"w{i}": make(jax.random.key(i)) for i in range(n)}
    return state, sum(x.nbytes for x in state.values()) / 1e6


def throughput(label: str, overrides: list[str], state, mb: float, workdir: Path, reps: int = 3) -> None:
    cfg = cfglib.load(None, [f"run.dir={workdir / label}", *overrides])
    save_s, restore_s, rows = [], [], []
    for r in range(reps):
        ckpt = ckptlib.Checkpointer(cfg, workdir / label, report=rows.append)
        t0 = time.perf_counter()
        ckpt.save(r + 1, state, {})
        assert ckpt.finish() is True
        save_s.append(time.perf_counter() - t0)
        abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        t0 = time.perf_counter()
        restored, _ = ckpt.restore(r + 1, abstract)
        jax.block_until_ready(restored)
        restore_s.append(time.perf_counter() - t0)
        ckpt.close()
    print(f"{label}: {mb:.0f} MB; save (until committed) {mb / min(save_s):.0f} MB/s best, "
          f"{mb / statistics.median(save_s):.0f} MB/s median; restore {mb / min(restore_s):.0f} MB/s best, "
          f"{mb / statistics.median(restore_s):.0f} MB/s median ({reps} reps)")
    checksum = statistics.median(r["checksum_s"] for r in rows if "checksum_s" in r)
    print(f"{label}: sizes + CRC32C of every file, on the checkpoint thread: median {1e3 * checksum:.0f} ms "
          f"per save ({mb / checksum:.0f} MB/s; {100 * checksum / statistics.median(save_s):.0f}% of the save "
          f"until committed); a restore checks them again before reading")


def moto(workdir: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    own = Path(sys.executable).parent / "moto_server"  # this environment's, not another one on PATH
    exe = str(own) if own.exists() else shutil.which("moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(150):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    import s3fs
    endpoint = f"http://127.0.0.1:{port}"
    s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("bench")
    return proc, endpoint


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument("--data", default=str(Path(os.environ.get("JAXTRAIN_SHARED", REPO.parent / "shared"))
                                              / "data" / "tinyshakespeare.txt"))
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="ckpt_speed_"))
    print(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices, workdir {workdir}")
    blocking_vs_step(args.data, args.steps, workdir)
    state, mb = synthetic_state(args.mb)
    throughput("local", [], state, mb, workdir)
    if not args.no_s3:
        proc, endpoint = moto(workdir)
        try:
            throughput("s3 (moto_server)", ["checkpoint.dir=s3://bench/ckpt", f"checkpoint.s3_endpoint={endpoint}"],
                       state, mb, workdir)
        finally:
            proc.terminate()
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
