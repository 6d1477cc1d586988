#!/usr/bin/env bash
# The GPU check in one go, for a lent GPU machine (see issue: GPU minutes are few): installs
# nothing beyond carried wheels, builds random-weight models there, runs the Triton/sampler/graph
# tests, the GPU benchmark and the GPU tests, each under a timeout, and writes logs and JSON to $1.
#
#   bash benchmarks/gpu_check.sh OUT_DIR
#
# env: SECTIONS, LEVELS and BENCH_ARGS (bench_gpu.py's), *_S (each step's timeout in seconds),
# KERNEL_TESTS=0 (skip the Triton kernel tests), SKIP_TESTS=1 (skip the GPU tests), WORKERS (pytest -n).
#
# Expects, beside the checkout: .gpu/smollm2/ (SmolLM2's config.json and tokenizer files; the GPU
# machine reaches no hub) and, where the machine lacks them, wheels in .whl/ (llguidance, gguf).
set -u
OUT=${1:-/tmp/gpu-check}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{ nvidia-smi -L; $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } 2>&1 | tee "$OUT/env.txt"
step() {  # name, seconds, command...
  local name=$1 seconds=$2; shift 2
  local t0=$SECONDS
  timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  tail -n 4 "$OUT/$name.log"
}
if [ "${KERNEL_TESTS:-1}" != 0 ]; then
  step kernel_tests "${KERNEL_TESTS_S:-180}" $PY -m pytest -q -p no:cacheprovider tests/kernels/test_triton_kernels.py
fi
step bench "${BENCH_S:-300}" $PY benchmarks/bench_gpu.py --config-dir .gpu/smollm2 --out "$OUT/bench_gpu.json" \
  --only "${SECTIONS:-bandwidth,smollm2,llama1b,concurrency}" --levels "${LEVELS:-64,256}" ${BENCH_ARGS:-}
if [ "${SKIP_TESTS:-0}" != 1 ]; then   # several workers: most of a test's time is Triton compiling for its shapes
  step gpu_tests "${GPU_TESTS_S:-240}" $PY -m pytest -q -p no:cacheprovider -n "${WORKERS:-6}" tests/test_gpu.py \
    tests/sampling/test_device_sampler.py tests/worker/test_cuda_graphs.py
fi
sed -n '/^device:/,$p' "$OUT/bench.log" | head -80
