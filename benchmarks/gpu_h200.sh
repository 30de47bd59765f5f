#!/usr/bin/env bash
# One-H200 benchmark: a Llama-style ~1.1B decoder (configs/llama_1b_h200.yaml: bf16 compute,
# seq 2048, global batch 8, scan over layers, save-matmuls remat) for 30 timed steps after
# 3 warm-up steps. Prints step time, tokens/s and MFU against the table peak (H200 bf16 dense
# 989 TFLOP/s), writes benchmarks/out/gpu_h200.json and appends a row to benchmarks/RESULTS.md.
# Expected: ~1-2 min compile + < 1 min of steps, well under 8 minutes.
#
#   bash benchmarks/gpu_h200.sh            # on the GPU machine (jax[cuda] installed)
#   bash benchmarks/gpu_h200.sh --smoke    # on CPU: validate the config and compile the
#                                          # full-size step from shapes only (no allocation)
#
# The GPU image has jax/flax/optax/orbax but not grain/array-record: install jaxtrain with
# `pip install --no-deps -e .` plus those wheels first (see the device tool's README).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if [[ "${1:-}" == "--smoke" ]]; then
  shift
  JAX_PLATFORMS=cpu exec "$PY" benchmarks/step.py --config llama_1b_h200 --abstract "$@"
fi
"$PY" - <<'PYEOF'
import jax
d = jax.devices()[0]
print(f"devices: {len(jax.devices())} x {d.device_kind} ({d.platform}), jax {jax.__version__}")
if d.platform != "gpu":
    raise SystemExit("gpu_h200.sh: no GPU visible to JAX (use --smoke on CPU)")
PYEOF
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
exec timeout 470 "$PY" benchmarks/step.py --config llama_1b_h200 --steps 30 --warmup 3 \
  --json benchmarks/out/gpu_h200.json --write-results "$@"
