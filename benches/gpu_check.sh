#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU (and no Rust), install a gpupool wheel built
# elsewhere and run benches/gpu_check.py, which writes $OUT/gpu_check.json. Meant to finish
# within five minutes.
#
# Here (with Rust):   maturin build --release --out target/wheels
# On the GPU machine: bash benches/gpu_check.sh            (the `device` tool: carry target/wheels)
#
# Environment: GPUPOOL_WHEEL (default: the newest abi3 wheel in target/wheels), OUT (where the
# report, logs and raw timings go; default /tmp/gpupool-gpu-check), PYTHON (default python3).
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

echo "== check"
# Tests, a training loop with and without the PyTorch hook, the CuPy and Numba hooks, and the
# seed article's workloads; each step has its own time limit (benches/gpu_check.py).
"$PYTHON" benches/gpu_check.py --out "$OUT" 2>&1 | tee "$OUT/check.log"
status=${PIPESTATUS[0]}
echo "== done (status $status); report in $OUT/gpu_check.json"
exit $status
