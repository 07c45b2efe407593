"""CuPy allocating its arrays from a gpupool pool, with ``cupy.cuda.set_allocator``.

Each allocation is made for CuPy's current stream, and memory returns to the pool, in that
stream's order, when CuPy drops the array. Needs CuPy and a GPU; without them it prints one
"skipped" line and exits 0.

    python examples/cupy_hook.py
"""

import sys

import gpupool
import gpupool.cupy  # imports CuPy only when the allocator is made

MiB = 1 << 20


def skip(why: str) -> None:
    print(f"skipped: {why}")
    sys.exit(0)


try:
    import cupy
except ImportError:
    skip("cupy not installed")
if not gpupool.cuda_available():
    skip("no CUDA GPU")

pool = gpupool.Pool("cuda:0")  # any strategy; CuPy needs a CUDA device
cupy.cuda.set_allocator(gpupool.cupy.allocator(pool))

x = cupy.random.default_rng(0).standard_normal((2048, 2048), dtype=cupy.float32)
gram = x @ x.T
print(f"trace of x @ x.T: {float(gram.trace()):.1f}")
print(f"pool: allocated {pool.memory_allocated() / MiB:.1f} MiB, reserved {pool.memory_reserved() / MiB:.1f} MiB")

side = cupy.cuda.Stream(non_blocking=True)
with side:  # arrays made here are allocated for the side stream
    y = cupy.ones(4 << 20, dtype=cupy.float32) * 3
    total = float(y.sum())
side.synchronize()
print(f"on a side stream: sum {total:.0f}; pool allocated {pool.memory_allocated() / MiB:.1f} MiB")

del x, gram, y
pool.synchronize()
print(f"arrays dropped: allocated {pool.memory_allocated()} B, {pool.memory_reserved() / MiB:.1f} MiB still cached")
pool.empty_cache()
print(f"after empty_cache(): reserved {pool.memory_reserved() / MiB:.1f} MiB")
