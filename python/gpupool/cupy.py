"""CuPy: an allocator function over gpupool pools, for ``cupy.cuda.set_allocator``.

CuPy is imported only when the allocator is made or called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gpupool


def allocator(pool: gpupool.Pool | None = None) -> Callable[[int], Any]:
    """``cupy.cuda.set_allocator(gpupool.cupy.allocator(pool))`` makes CuPy allocate from ``pool``.

    Without ``pool``, one pool per device, opened when CuPy first allocates on it; with one, an
    allocation while another device is CuPy's current one is a ``ValueError`` (CuPy's allocator
    is process-wide, a pool serves one device). Each allocation is made for CuPy's current stream
    and each CuPy buffer holds its ``DevicePtr``, so memory returns to the pool, in that stream's
    order, when CuPy drops the buffer. A request the device cannot serve raises
    ``gpupool.OutOfMemoryError`` (a ``MemoryError``, as CuPy's own is) with the pool's report.
    """
    import cupy

    if pool is not None and not pool.device.startswith("cuda:"):
        raise ValueError(f"CuPy needs a CUDA pool, not one on '{pool.device}'")
    pools: dict[int, gpupool.Pool] = {} if pool is None else {int(pool.device.split(":")[1]): pool}
    # Blocks are cached per stream, like CuPy's own pool: a block freed on one stream is not
    # handed to another while the first may still use it. Keyed by (device, raw handle).
    streams: dict[tuple[int, int], gpupool.Stream] = {}

    def malloc(size: int) -> cupy.cuda.MemoryPointer:
        device_id = cupy.cuda.Device().id
        target = pools.get(device_id)
        if target is None:
            if pool is not None:
                raise ValueError(f"this allocator serves {pool.device}, but CuPy's current device is cuda:{device_id}")
            target = pools[device_id] = gpupool.Pool(f"cuda:{device_id}")
        handle = cupy.cuda.get_current_stream().ptr
        stream = streams.get((device_id, handle))
        if stream is None:
            stream = streams[(device_id, handle)] = target.external_stream(handle)
        ptr = target.alloc(size, stream=stream)
        memory = cupy.cuda.UnownedMemory(ptr.ptr, size, ptr, device_id)
        return cupy.cuda.MemoryPointer(memory, 0)

    return malloc
