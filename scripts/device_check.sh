#!/usr/bin/env bash
# One prepared check for a machine with one NVIDIA GPU, under 8 minutes (the stage limits sum
# to 470 s when jax is preinstalled): the GPU kernel tests compiled for the real chip (no
# interpret mode), `jaxkv bench kernels`, and an end-to-end jaxkv.generate with the Pallas
# kernels against the reference attention. Every stage has its own time limit and log; a
# failing stage is recorded and the next one still runs.
#
#     OUT=/some/dir bash scripts/device_check.sh        (default OUT: out/device)
#
# Results: $OUT/summary.txt (what ran, exit codes, the tables), one log per stage, and the
# bandwidth plot. Uses the jax already installed when it sees a GPU (machines without a network);
# otherwise installs the `cuda` extra.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/device}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
START=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

note() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$SUMMARY"; }

stage() {  # stage NAME SECONDS CMD...: run with a limit, log to $OUT/NAME.log, keep the tail
  local name=$1 limit=$2
  shift 2
  note "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  note "   $name: exit $rc$([ $rc = 124 ] && echo ' (time limit)')"
  tail -n 40 "$OUT/$name.log" | sed 's/^/   | /' >>"$SUMMARY"
  return 0
}

stage env 30 bash -c "nvidia-smi; $PY -c 'import sys, jax, jaxlib; print(sys.version); \
print(\"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__); print(jax.devices())'"

if $PY -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
  stage install 60 $PY -m pip install --no-deps --no-build-isolation -e .
else
  stage install 300 $PY -m pip install -e ".[cuda,test]"
fi

# The kernel tests on the GPU: compiled kernels, exact f32 on both sides of each comparison.
stage kernels 120 env JAX_PLATFORMS=cuda JAXKV_KERNELS_ON_DEVICE=1 \
  JAX_DEFAULT_MATMUL_PRECISION=highest \
  $PY -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py

# Decode bandwidth: Llama-3-8B-like heads (8 kv heads, GQA 8, head_dim 128; 11 shapes up to
# 8 GiB of KV), then Llama-3.2-1B-like (GQA 4, head_dim 64; 4 shapes), against JAX's shipped
# kernel and the XLA reference.
stage bench 180 bash -c "$PY -m jaxkv.bench kernels --max-kv-gib 8 --repeats 10 \
  --out $OUT/bench_kernels.png && \
  $PY -m jaxkv.bench kernels --group 4 --head-dim 64 --batch 8 64 --context 4096 32768 \
  --repeats 10 --out $OUT/bench_kernels_d64.png"

stage generate 80 $PY scripts/check_generate.py --batch 8 --max-tokens 64

note "done in $(( $(date +%s) - START ))s; logs in $OUT"
