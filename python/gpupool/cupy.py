"""CuPy: an allocator function over a gpupool pool, for ``cupy.cuda.set_allocator``.

CuPy is imported only when the allocator is made or called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gpupool


def allocator(pool: gpupool.Pool | None = None) -> Callable[[int], Any]:
    """``cupy.cuda.set_allocator(gpupool.cupy.allocator(pool))`` makes CuPy allocate from ``pool``.

    Without ``pool``, a new pool over CuPy's current device. Each CuPy buffer holds its
    ``DevicePtr``, so memory returns to the pool when CuPy drops the buffer.
    """
    import cupy

    if pool is None:
        pool = gpupool.Pool(f"cuda:{cupy.cuda.Device().id}")
    if not pool.device.startswith("cuda:"):
        raise ValueError(f"CuPy needs a CUDA pool, not one on '{pool.device}'")
    device_id = int(pool.device.split(":")[1])
    # Blocks are cached per stream, like CuPy's own pool: a block freed on one stream is not
    # handed to another while the first may still use it.
    streams: dict[int, gpupool.Stream] = {0: pool.default_stream}

    def malloc(size: int) -> cupy.cuda.MemoryPointer:
        handle = cupy.cuda.get_current_stream().ptr
        if handle not in streams:
            streams[handle] = pool.external_stream(handle)
        ptr = pool.alloc(size, stream=streams[handle])
        memory = cupy.cuda.UnownedMemory(ptr.ptr, size, ptr, device_id)
        return cupy.cuda.MemoryPointer(memory, 0)

    return malloc
