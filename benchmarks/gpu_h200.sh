#!/usr/bin/env bash
# One-H200 benchmark: a Llama-style ~1.1B decoder (configs/llama_1b_h200.yaml: bf16 compute,
# seq 2048, global batch 8, scan over layers, save-matmuls remat), step time, tokens/s and MFU
# against the table peak (H200 bf16 dense 989 TFLOP/s).
#
#   bash benchmarks/gpu_h200.sh --fetch-wheels   # here, with network: what the GPU image lacks, as
#                                                # Python 3.12 wheels, into .whl/ (git-ignored)
#   bash benchmarks/gpu_h200.sh [--budget S]     # on the GPU machine, from this source checkout
#   bash benchmarks/gpu_h200.sh --smoke          # on CPU: validate and compile the step from shapes
#
# The GPU machine has no network and runs the source tree without installing it: the wheels in
# .whl/ (pydantic, grain, array-record, google-crc32c, portpicker and their missing needs) are
# installed offline into /tmp/jaxtrain-site. Everything measured goes to $OUT (default
# benchmarks/out): JSON per stage, the logs, and RESULTS.md with the new rows, since only $OUT
# comes back from that machine. Stages run by value while the budget (default 480 s) lasts:
#   1. the 1.1B step with model.attention=auto (cuDNN on an H200), 30 steps, without jaxtrain's GPU XLA
#      flags (JAXTRAIN_XLA_GPU_FLAGS=0): the MFU baseline;
#   2. the same step with the flags (jaxtrain/runtime/xla_flags.py, the trainer's default on a GPU);
#   3. the same step at global batch 16 (does a larger step raise the MFU?), 20 steps;
#   4. the same step with the optimizer state in host memory (offload.optimizer=host) against the step
#      without it: step time and device memory (benchmarks/offload.py, 10 steps each, one round);
#   5. the same step with our Pallas (Triton) flash attention, 10 steps;
#   6. the 25M config, 20 steps (a small-model row);
#   7-9. with time left: Triton GEMMs off, no remat, the 25M config in bf16;
#   10-11. the trainer: README's default run, and crash trials (SIGKILL, resume, losses bit for bit);
#   12-14. a 0.43B MoE, dropless (ragged_dot, then model.grouped_matmul=blocks) and capacity, against
#      the dense model of its active parameters;
#   15. that MoE's expert layer alone (benchmarks/moe_kernels.py): which grouped matmul is fastest.
# `--only a,b` runs the named stages alone (a second, shorter lease).
# CI lowers stage 1's step (with Pallas attention) for `cuda` on CPU: tests/test_gpu_lowering.py, and
# stage 4's with offload: tests/unit/test_offload_lowering.py.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0 grain==0.2.18 array-record==0.8.6 google-crc32c==1.9.0 portpicker==1.6.0)

case "${1:-}" in
  --fetch-wheels)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
    echo "wheels in .whl/; carry .whl to the GPU machine"
    exit 0 ;;
  --smoke)
    shift
    JAX_PLATFORMS=cpu exec "$PY" benchmarks/step.py --config llama_1b_h200 --abstract "$@" ;;
esac
BUDGET=480 ONLY=""
while (( $# )); do
  case "$1" in
    --budget) BUDGET=$2; shift 2 ;;
    --only) ONLY=",$2,"; shift 2 ;;  # comma-separated stage names, e.g. a second lease's leftovers
    *) echo "gpu_h200.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
OUT=${OUT:-$REPO/benchmarks/out}
mkdir -p "$OUT"

export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/jaxtrain-site .whl/*.whl
  export PYTHONPATH=/tmp/jaxtrain-site:$PYTHONPATH
fi
"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/environment.txt"
import importlib, jax
missing = []
for name in ("pydantic", "grain", "array_record", "google_crc32c", "jaxtrain.models", "jaxtrain.data", "jaxtrain.train"):
    try:
        importlib.import_module(name)
    except Exception as err:  # every missing piece at once, not one per try
        missing.append(f"{name}: {type(err).__name__}: {err}")
d = jax.devices()[0]
print(f"devices: {len(jax.devices())} x {d.device_kind} ({d.platform}), jax {jax.__version__}")
from importlib import metadata
for dist in ("jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "pydantic", "numpy"):
    try:
        print(f"{dist} {metadata.version(dist)}")
    except metadata.PackageNotFoundError:
        print(f"{dist} not installed")
if missing:
    raise SystemExit("gpu_h200.sh: cannot import\n  " + "\n  ".join(missing) + "\n(run --fetch-wheels here and carry .whl)")
if d.platform != "gpu":
    raise SystemExit("gpu_h200.sh: no GPU visible to JAX (use --smoke on CPU)")
PYEOF
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}

run_stage() {  # name, minimum seconds worth starting with, then a command; its output to $OUT/name.log
  local name=$1 need=$2; shift 2
  if [[ -n "$ONLY" && "$ONLY" != *",$name,"* ]]; then return 0; fi
  local t; t=$(left)
  if (( t < need )); then echo "skip $name: ${t}s left of the ${BUDGET}s budget" | tee -a "$OUT/stages.txt"; return 0; fi
  echo "stage $name (${t}s left)" | tee -a "$OUT/stages.txt"
  local rc=0
  timeout $(( t - 10 )) "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  tail -n 20 "$OUT/$name.log"
  echo "stage $name: rc $rc" | tee -a "$OUT/stages.txt"
  cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
}
stage() {  # name, minimum seconds, then the script's arguments ($SCRIPT, default step.py)
  local name=$1 need=$2 script=${SCRIPT:-benchmarks/step.py}; shift 2
  run_stage "$name" "$need" "$PY" "$script" --json "$OUT/$name.json" --write-results "$@"
}
JAXTRAIN_XLA_GPU_FLAGS=0 stage llama_1b_auto 180 --config llama_1b_h200 --steps 30 --warmup 3 data.path=stdlib
stage llama_1b_gpu_flags 150 --config llama_1b_h200 --steps 30 --warmup 3 data.path=stdlib
stage llama_1b_batch16 150 --config llama_1b_h200 --steps 20 --warmup 3 data.path=stdlib train.global_batch=16
SCRIPT=benchmarks/offload.py stage llama_1b_offload 200 --config llama_1b_h200 --variants none,optimizer --rounds 1 \
  --steps 10 --warmup 2 data.path=stdlib
stage llama_1b_pallas 150 --config llama_1b_h200 --steps 10 --warmup 2 data.path=stdlib model.attention=pallas
stage llama_25m 60 --config llama_25m --steps 20 --warmup 3 data.path=stdlib data.tokenizer=byte
# With time left: MaxText's a3 recipes also turn XLA's Triton GEMMs off (cuBLAS for every matmul);
# the step without remat; the small model in bf16.
XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_triton_gemm=false" \
  stage llama_1b_triton_gemm_off 120 --config llama_1b_h200 --steps 20 --warmup 3 data.path=stdlib
stage llama_1b_no_remat 120 --config llama_1b_h200 --steps 20 --warmup 3 data.path=stdlib model.remat=none
stage llama_25m_bf16 60 --config llama_25m --steps 20 --warmup 3 data.path=stdlib data.tokenizer=byte \
  model.dtype=bfloat16
# The trainer itself on the GPU: README's default run (on the stdlib corpus: shared/ does not travel),
# then SIGKILL crash trials (async Orbax saves, resume, every loss equal to an uninterrupted run's).
run_stage trainer_default 90 "$PY" -m jaxtrain.train data.path=stdlib run.progress=false run.dir=/tmp/jaxtrain-default
run_stage crash_trials 120 "$PY" benchmarks/crash_trials.py --trials 4 --steps 12 --data stdlib
# A 0.43B Mixtral-style MoE (8 experts of d_ff 2048, top-2, 8 layers of d_model 1024, seq 1024, bf16)
# dropless (grouped GEMMs: ragged_dot) and with capacity routing, against the dense model of the same
# active parameters (d_ff 4096).
MOE=(data.path=stdlib data.tokenizer=byte data.seq_len=1024 train.global_batch=16 model.dtype=bfloat16
     model.d_model=1024 model.n_layers=8 model.n_heads=16 model.n_kv_heads=8)
stage moe_dropless 90 --config moe_shakespeare --steps 20 --warmup 3 "${MOE[@]}" model.d_ff=2048
stage moe_dropless_blocks 90 --config moe_shakespeare --steps 20 --warmup 3 "${MOE[@]}" model.d_ff=2048 \
  model.grouped_matmul=blocks
stage moe_capacity 70 --config moe_shakespeare --steps 20 --warmup 3 "${MOE[@]}" model.d_ff=2048 model.routing=capacity
stage moe_dense 60 --config shakespeare_char --steps 20 --warmup 3 "${MOE[@]}" model.d_ff=4096
# Its expert layer alone, forward and backward: ragged_dot, the CPU's windows, batched buffers, per-expert.
run_stage moe_kernels 90 "$PY" benchmarks/moe_kernels.py --rounds 3 --iters 10 --shape 16384,1024,2048,8,2 \
  --dtype bfloat16 --write-results
echo "results in $OUT"
