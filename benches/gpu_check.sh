#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU (and no Rust), install a gpupool wheel built
# elsewhere, run the CUDA tests, then the GPU benchmark. Meant to finish within 4 minutes.
#
# Here (with Rust):   maturin build --release --out target/wheels
# On the GPU machine: bash benches/gpu_check.sh            (the `device` tool: carry target/wheels)
#
# Environment: GPUPOOL_WHEEL (default: the newest abi3 wheel in target/wheels), OUT (where logs,
# the table and the raw timings go; default /tmp/gpupool-gpu-check), PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpupool-gpu-check}
SITE=${GPUPOOL_SITE:-/tmp/gpupool-site}
WHEEL=${GPUPOOL_WHEEL:-$(ls -t target/wheels/gpupool-*-abi3-manylinux*.whl 2>/dev/null | head -n 1)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if [ -z "$WHEEL" ] || [ ! -f "$WHEEL" ]; then
    echo "no gpupool wheel: build one with 'maturin build --release --out target/wheels'" >&2
    exit 2
fi
echo "== installing $WHEEL"
rm -rf "$SITE"
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEEL" || exit 2
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

echo "== machine"
{
    date -u +"%Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    "$PYTHON" -c 'import sys, gpupool; print("python", sys.version.split()[0], "| gpupool", gpupool.__version__,
        "| cuda_available", gpupool.cuda_available(), "| devices", gpupool.device_count())'
    "$PYTHON" -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' 2>/dev/null
    "$PYTHON" -c 'import cupy; print("cupy", cupy.__version__)' 2>/dev/null
} | tee "$OUT/machine.txt"

status=0
echo "== CUDA tests"
# The suite's pytest settings stay (warnings are errors); only unknown-option warnings are let pass.
timeout 170 "$PYTHON" -m pytest -q -p no:cacheprovider -W ignore::pytest.PytestConfigWarning -rs \
    tests/test_cuda_gpu.py tests/test_interop.py 2>&1 | tee "$OUT/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== GPU benchmark"
# GPUPOOL_BENCH_ARGS adds options (e.g. "--scale 0.1" for a dry run on a small device).
timeout 60 "$PYTHON" benches/gpu_bench.py --device cuda:0 --json "$OUT/bench.json" ${GPUPOOL_BENCH_ARGS:-} 2>&1 |
    tee "$OUT/bench.md"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== done (status $status); logs in $OUT"
exit $status
