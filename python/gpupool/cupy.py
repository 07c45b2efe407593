"""CuPy: an allocator function over gpupool pools, for ``cupy.cuda.set_allocator``.

CuPy is imported only when the allocator is made or called.
"""

from __future__ import annotations

import functools
import gc
import sys
from collections.abc import Callable
from typing import Any

import gpupool

# cudaStreamPerThread: the calling thread's own default stream, whichever thread calls.
CUDA_STREAM_PER_THREAD = 2


@functools.cache
def _out_of_memory_class() -> type:
    """CuPy's ``OutOfMemoryError`` that is also gpupool's, so that ``except`` clauses for either
    (CuPy's own fallbacks among them) catch it."""
    from cupy.cuda.memory import OutOfMemoryError

    class CupyOutOfMemoryError(OutOfMemoryError, gpupool.OutOfMemoryError):
        """CuPy's OutOfMemoryError that is also gpupool's; ``report`` holds the pool's out-of-memory report."""

        def __init__(self, size: int, total: int, report: str) -> None:
            OutOfMemoryError.__init__(self, size, total)
            self.report = report
            self.args = (f"{self.args[0]} gpupool: {report}",)

        def __reduce__(self) -> tuple:
            return (type(self), (self._size, self._total, self.report))

    # Pickled by reference, so under a name the module answers to (see __getattr__ below).
    CupyOutOfMemoryError.__qualname__ = CupyOutOfMemoryError.__name__
    return CupyOutOfMemoryError


def __getattr__(name: str) -> Any:
    # The error class derives from CuPy's, so it is built on first access (unpickling asks here).
    if name == "CupyOutOfMemoryError":
        try:
            return _out_of_memory_class()
        except ImportError as e:
            # Without CuPy the class does not exist: an AttributeError keeps hasattr() and
            # getattr(..., default) working, and says why.
            raise AttributeError(f"gpupool.cupy.CupyOutOfMemoryError needs CuPy: {e}") from e
    raise AttributeError(f"module 'gpupool.cupy' has no attribute {name!r}")


def allocator(pool: gpupool.Pool | None = None) -> Callable[[int], Any]:
    """``cupy.cuda.set_allocator(gpupool.cupy.allocator(pool))`` makes CuPy allocate from ``pool``.

    Without ``pool``, one pool per device, opened when CuPy first allocates on it; with one, an
    allocation while another device is CuPy's current one is a ``ValueError`` (CuPy's allocator
    is process-wide, a pool serves one device). Each allocation is made for CuPy's current stream
    and each CuPy buffer holds its ``DevicePtr``, so memory returns to the pool, in that stream's
    order, when CuPy drops the buffer. A request the device cannot serve, even after a garbage
    collection (CuPy's own pool collects before giving up too), raises an error that is both
    ``cupy.cuda.memory.OutOfMemoryError`` and ``gpupool.OutOfMemoryError``, with the pool's report.

    A CuPy stream destroys its handle when the object dies, and the pool may still record events
    on a stream it has blocks of: the allocator keeps each stream it served alive, and lets one go
    (after the pool is done with it) once nothing else holds it and CuPy switches to a stream it
    has not served yet.
    """
    import cupy

    if pool is not None and not pool.device.startswith("cuda:"):
        raise ValueError(f"CuPy needs a CUDA pool, not one on '{pool.device}'")
    pools: dict[int, gpupool.Pool] = {} if pool is None else {int(pool.device.split(":")[1]): pool}
    # Blocks are cached per stream, like CuPy's own pool: a block freed on one stream is not
    # handed to another while the first may still use it. Keyed by (device, raw handle), with
    # the CuPy stream object, held so that its handle outlives the pool's use of it.
    streams: dict[tuple[int, int], tuple[Any, gpupool.Stream]] = {}

    def release_unused_streams() -> None:
        for key in list(streams):
            # Held only by the entry (and getrefcount's argument). CuPy never destroys the null,
            # legacy and per-thread streams (0, 1, 2).
            if key[1] > 2 and sys.getrefcount(streams[key][0]) <= 2:
                try:
                    streams[key][1].destroy()  # waits for the stream's work, then forgets its handle
                except (RuntimeError, ValueError):
                    continue
                del streams[key]

    def malloc(size: int) -> cupy.cuda.MemoryPointer:
        device_id = cupy.cuda.Device().id
        target = pools.get(device_id)
        if target is None:
            if pool is not None:
                raise ValueError(f"this allocator serves {pool.device}, but CuPy's current device is cuda:{device_id}")
            target = pools[device_id] = gpupool.Pool(f"cuda:{device_id}")
        current = cupy.cuda.get_current_stream()
        if current.ptr == CUDA_STREAM_PER_THREAD:
            # One handle for a different stream on each thread: the pool's fences and per-stream
            # reuse could not tell them apart.
            raise ValueError(
                "gpupool.cupy does not serve CuPy's per-thread default stream (CUPY_CUDA_PER_THREAD_DEFAULT_STREAM): "
                "use cupy.cuda.Stream objects"
            )
        entry = streams.get((device_id, current.ptr))
        if entry is None:
            release_unused_streams()
            entry = streams[(device_id, current.ptr)] = (current, target.external_stream(current.ptr))
        del current
        try:
            ptr = target.alloc(size, stream=entry[1])
        except gpupool.OutOfMemoryError:
            gc.collect()  # memory held by garbage cycles of CuPy arrays comes back
            try:
                ptr = target.alloc(size, stream=entry[1])
            except gpupool.OutOfMemoryError as e:
                raise _out_of_memory_class()(size, target.memory_allocated(), str(e)) from e
        memory = cupy.cuda.UnownedMemory(ptr.ptr, size, ptr, device_id)
        return cupy.cuda.MemoryPointer(memory, 0)

    return malloc
