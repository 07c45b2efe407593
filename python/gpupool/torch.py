"""PyTorch: serve ``torch.cuda`` allocations from gpupool through PyTorch's pluggable allocator.

The extension module exports ``gpupool_alloc`` / ``gpupool_free`` with the signatures
``CUDAPluggableAllocator`` expects; they serve one process-wide pool per device. PyTorch is
imported only when ``install`` is called.
"""

from __future__ import annotations

from gpupool import _native

ALLOC_SYMBOL = "gpupool_alloc"
FREE_SYMBOL = "gpupool_free"


def install(config: str | None = None) -> None:
    """Makes gpupool PyTorch's CUDA allocator, with ``config`` as for ``gpupool.Pool``.

    Call it before PyTorch allocates any CUDA memory: PyTorch cannot swap an allocator in use.
    """
    from torch.cuda.memory import CUDAPluggableAllocator, change_current_allocator

    _native._capi_configure("cuda", config or "")
    change_current_allocator(CUDAPluggableAllocator(_native.__file__, ALLOC_SYMBOL, FREE_SYMBOL))


def memory_stats(device: int = 0) -> dict[str, int]:
    """The statistics of device ``device``'s pool (empty before its first allocation)."""
    return _native._capi_memory_stats(device) or {}


def empty_cache() -> int:
    """Returns every fully free cached segment to the driver; returns the bytes released."""
    return _native._capi_empty_cache()


def last_error() -> str | None:
    """Why the latest allocation or free failed (PyTorch only sees a null pointer)."""
    return _native._capi_last_error()
