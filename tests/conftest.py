"""Shared test set-up: 8 simulated CPU devices (no persistent compile cache over them), small configs, a GCS emulator.

The tests come in two tiers: ``tests/unit`` (no subprocess, no server, no second process) and
``tests/integration`` (real servers, SLURM, multi-process jobs, notebooks, parity with transformers);
their shared helpers are in ``tests/helpers`` (on the import path). A test that uses a server fixture
is marked ``servers``; the slowest are marked ``slow`` where they are defined.
"""
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
import xla_test_flags  # noqa: E402
from mlflow_service import MlflowServer  # noqa: E402

# Must happen before jax is imported anywhere.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
if xla_test_flags.FLAGS not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + xla_test_flags.FLAGS
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Trainer processes the tests start keep their exported programs here, not in the user's ~/.cache.
os.environ.setdefault("JAXTRAIN_PROGRAM_CACHE_DIR", str(REPO / ".program_cache"))

import jax  # noqa: E402
import pytest  # noqa: E402

SERVER_FIXTURES = {"s3_server", "gcs", "gcs_server", "mlflow_server", "registry", "slurm_cluster"}
jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("JAX_COMPILATION_CACHE_DIR", str(REPO / ".jax_cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
# Programs over several devices are compiled every time, never read from that cache: XLA:CPU runs the
# collectives of a program loaded from it unordered, which can deadlock
# (jaxtrain.cli.common.enable_compilation_cache; the command line leaves the cache off for such runs).
from jax._src import compiler as _compiler  # noqa: E402

_resolve = _compiler._resolve_compilation_strategy


def _single_device_only(computation, devices, compile_options, *args, **kwargs):
    if devices.size > 1:
        return None, compile_options  # no cache key: compiled, neither read nor written
    return _resolve(computation, devices, compile_options, *args, **kwargs)


_compiler._resolve_compilation_strategy = _single_device_only

from jaxtrain import config as cfglib  # noqa: E402

SHAKESPEARE = Path(os.environ.get("JAXTRAIN_SHARED", REPO.parent / "shared")) / "data" / "tinyshakespeare.txt"

# A small model that still exercises every sharded dimension on a 2x2x2 mesh.
SMALL = [
    "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
    "data.tokenizer=byte", "data.seq_len=32", "train.global_batch=8", "train.log_every=1",
    "train.eval_every=1000", "train.eval_batches=2", "train.sample_tokens=8", "optimizer.warmup_steps=5",
    "run.progress=false",
]


@pytest.fixture(scope="session")
def corpus_path() -> str:
    if not SHAKESPEARE.is_file():
        pytest.fail(f"test corpus missing: {SHAKESPEARE} (set JAXTRAIN_SHARED to the shared/ folder)")
    return str(SHAKESPEARE)


@pytest.fixture
def small_cfg(tmp_path, corpus_path):
    """small_cfg('train.steps=5', ...) -> Config with the SMALL model, run dir in tmp_path."""
    def make(*overrides: str, run_dir: str = "run"):
        return cfglib.load(None, [*SMALL, f"data.path={corpus_path}", f"run.dir={tmp_path / run_dir}", *overrides])
    return make


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """Starts moto_server (bucket ``ckpts``); yields its endpoint URL with credentials set for it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    own = Path(sys.executable).parent / "moto_server"  # this environment's first, not another one on PATH
    exe = str(own) if own.exists() else shutil.which("moto_server")
    if exe is None:
        pytest.fail(f"moto_server is neither in {own.parent} nor on PATH (pip install 'moto[server]')")
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"moto_server did not start on port {port}")
            time.sleep(0.2)
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    import s3fs
    s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("ckpts")
    yield endpoint
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    log.close()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """One fake-gcs-server (tests/gcs_server.py) for the session; stopped by its PID at the end."""
    from gcs_server import GcsServer
    server = GcsServer(tmp_path_factory.mktemp("gcs") / "server.log")
    yield server
    server.stop()


@pytest.fixture
def gcs(gcs_server, monkeypatch):
    """The emulator's environment for one test (restored after it); yields the server.

    gcsfs picks its class from the env at import and fsspec/epath cache its instances, so the
    flavour is checked and the caches are dropped on the way in and out.
    """
    from gcs_server import check_gcsfs_flavour, forget_gcs_clients
    for key, value in gcs_server.env().items():
        monkeypatch.setenv(key, value)
    check_gcsfs_flavour()
    forget_gcs_clients()
    yield gcs_server
    forget_gcs_clients()


def put_windows(windows, sharding):
    """[accum, micro, T + 1] token windows -> the batch dict of a windows-mode run, on ``sharding``."""
    import numpy as np

    from jaxtrain.data import packing
    return jax.device_put(packing.from_windows(np.asarray(windows)), sharding)


def pytest_collection_modifyitems(config, items):
    """Marks every test that starts or uses a real server (S3, GCS, MLflow, SLURM) ``servers``, and skips
    the ``kernels`` tests, saying why, where no C++ compiler runs (a compiler whose build fails fails them)."""
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.servers)
    kernel_items = [item for item in items if item.get_closest_marker("kernels")]
    why = no_compiler() if kernel_items else None
    for item in kernel_items if why else ():
        item.add_marker(pytest.mark.skip(reason=f"the XLA:CPU kernels need a C++ compiler: {why}"))


def no_compiler():
    """Why ``$CXX`` (default ``c++``, as the kernels' build runs it) cannot compile, or None."""
    import shlex
    compiler = shlex.split(os.environ.get("CXX") or "c++") or ["c++"]
    try:
        done = subprocess.run([*compiler, "--version"], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        return f"CXX={' '.join(compiler)} cannot be run ({err})"
    return None if done.returncode == 0 else f"CXX={' '.join(compiler)} --version exits {done.returncode}"


_SESSION_SERVERS: dict = {}


def pytest_collection_finish(session):
    """Starts the MLflow server now when a selected test needs it, so that its start overlaps earlier tests."""
    if not session.config.option.collectonly and any(
            "mlflow_server" in getattr(item, "fixturenames", ()) for item in session.items):
        _SESSION_SERVERS["mlflow"] = MlflowServer()


def pytest_sessionfinish(session, exitstatus):
    for server in _SESSION_SERVERS.values():
        server.stop()


@pytest.fixture(scope="session")
def mlflow_server():
    """`mlflow server` with a SQLite backend and a local artifact store, on 127.0.0.1; yields its URL."""
    server = _SESSION_SERVERS.get("mlflow") or _SESSION_SERVERS.setdefault("mlflow", MlflowServer())
    try:
        return server.wait()
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def windows(corpus_path):
    """5 batches [1, 8, 33] of Shakespeare bytes (deterministic): the sharding matrix's steps."""
    import numpy as np
    data = np.frombuffer(Path(corpus_path).read_bytes()[:200_000], np.uint8).astype(np.int32)
    starts = np.random.default_rng(0).integers(0, len(data) - 33, size=(5, 8))
    return np.stack([np.stack([data[s:s + 33] for s in row]) for row in starts])[:, None]
