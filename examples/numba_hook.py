"""Numba allocating its device arrays from gpupool, as an External Memory Management plugin.

``numba.cuda.set_memory_manager(gpupool.numba.GpupoolMemoryManager)`` before Numba makes its
context (or ``NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba`` in the environment); each context then
gets one pool, here read through the context's memory manager. Needs Numba and a GPU; without
them it prints one "skipped" line and exits 0.

    python examples/numba_hook.py
"""

import sys

import numpy as np

import gpupool
import gpupool.numba  # imports Numba only when the manager class is first used

MiB = 1 << 20


def skip(why: str) -> None:
    print(f"skipped: {why}")
    sys.exit(0)


try:
    from numba import cuda
except ImportError:
    skip("numba not installed")
if not gpupool.cuda_available():
    skip("no CUDA GPU")

cuda.set_memory_manager(gpupool.numba.GpupoolMemoryManager)


@cuda.jit
def scale(values, factor):
    i = cuda.grid(1)
    if i < values.size:
        values[i] *= factor


host = np.arange(4 * MiB // 4, dtype=np.float32)
values = cuda.to_device(host)  # 4 MiB from the pool
scale[(host.size + 255) // 256, 256](values, 2.0)
print("scaled on the GPU:", values.copy_to_host()[:4])

pool = cuda.current_context().memory_manager.pool
allocated, reserved = pool.memory_allocated() / MiB, pool.memory_reserved() / MiB
print(f"pool on {pool.device}: allocated {allocated:.1f} MiB, reserved {reserved:.1f} MiB")
free, total = cuda.current_context().get_memory_info()  # the driver's figures, as Numba reports them
print(f"device: {free / MiB:,.0f} MiB free of {total / MiB:,.0f} MiB")
del values  # the plugin frees at once, ordered after the work queued on the legacy stream
print(f"array dropped: allocated {pool.memory_allocated()} B, reserved {pool.memory_reserved() / MiB:.1f} MiB")
