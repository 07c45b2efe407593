"""PyTorch: serve ``torch.cuda`` allocations from gpupool through PyTorch's pluggable allocator.

The extension module exports, with the signatures ``CUDAPluggableAllocator`` expects:
``gpupool_torch_alloc`` (allocation; a failure is thrown as a C++ exception, which PyTorch raises
in Python as a ``RuntimeError`` carrying gpupool's out-of-memory report, instead of handing out a
tensor at address 0), ``gpupool_free``, ``gpupool_record_stream`` (``tensor.record_stream``) and
``gpupool_empty_cache`` (``torch.cuda.empty_cache``) and ``gpupool_set_memory_fraction``
(``torch.cuda.set_per_process_memory_fraction``). They serve one process-wide pool per device,
each with its own lock. PyTorch is imported only when ``install`` is called.

With any pluggable allocator PyTorch's own statistics (``torch.cuda.memory_stats``,
``memory_allocated``, ``memory_summary``, snapshots) raise: read ``memory_stats`` here instead.
cuDNN benchmarking fails too (it asks for the largest cached block, which PyTorch does not
forward), as do CUDA graphs (gpupool refuses to allocate on a capturing stream) and sharing CUDA
tensors through ``torch.multiprocessing`` (see README.md).
"""

from __future__ import annotations

import ctypes
import os

from gpupool import _native

ALLOC_SYMBOL = "gpupool_torch_alloc"
FREE_SYMBOL = "gpupool_free"
# PyTorch's Python constructor loads only the two symbols above; these reach the allocator object
# through its setters, named here as PyTorch's bindings name them.
HOOKS = {"set_record_stream_fn": "gpupool_record_stream", "set_reset_fn": "gpupool_empty_cache"}
# Registered where this PyTorch has the setter; without it a memory fraction set in PyTorch is lost.
OPTIONAL_HOOKS = {"set_memory_fraction_fn": "gpupool_set_memory_fraction"}
PYTORCH_ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def config_from_environment(pytorch_env: bool = False) -> str:
    """``GPUPOOL_ALLOC_CONF``, else with ``pytorch_env`` PyTorch's variables, else the defaults.

    The first variable that is set wins, even when set to nothing: PyTorch reads a set
    ``PYTORCH_ALLOC_CONF`` (an empty one meaning its defaults) and then ignores the deprecated
    ``PYTORCH_CUDA_ALLOC_CONF``, and ``gpupool.Pool`` reads an empty ``GPUPOOL_ALLOC_CONF`` so too.
    """
    names = ("GPUPOOL_ALLOC_CONF", *PYTORCH_ENV_VARS) if pytorch_env else ("GPUPOOL_ALLOC_CONF",)
    return next((os.environ[name] for name in names if name in os.environ), "")


def install(config: str | None = None, *, pytorch_env: bool = False) -> None:
    """Makes gpupool PyTorch's CUDA allocator, with ``config`` as for ``gpupool.Pool``.

    Without ``config``, ``GPUPOOL_ALLOC_CONF`` is read, and with ``pytorch_env=True`` also
    ``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF`` (every PyTorch key is understood;
    ``backend:cudaMallocAsync`` hands each request to the driver's stream-ordered pool). Call it
    before PyTorch initializes CUDA: PyTorch cannot swap an allocator it has set up, and
    ``torch.cuda.set_device``, ``current_device`` and ``current_stream`` initialize it as surely
    as a first allocation does. Raises ``RuntimeError`` if CUDA is initialized already (before
    changing anything), or if this PyTorch cannot forward ``record_stream`` and ``empty_cache`` to
    a pluggable allocator: without the first, a block used on a side stream could be reused early.
    """
    import torch
    from torch.cuda.memory import CUDAPluggableAllocator, change_current_allocator

    if torch.cuda.is_initialized():
        raise RuntimeError(
            "gpupool.torch.install() came after PyTorch initialized CUDA (a CUDA tensor, or a call such as "
            "torch.cuda.set_device or current_device), and PyTorch cannot swap its allocator then: call it first"
        )
    text = config if config is not None else config_from_environment(pytorch_env)
    allocator = CUDAPluggableAllocator(_native.__file__, ALLOC_SYMBOL, FREE_SYMBOL)
    native = allocator.allocator()
    missing = [setter for setter in HOOKS if not callable(getattr(native, setter, None))]
    if missing:
        raise RuntimeError(
            f"this PyTorch's pluggable allocator lacks {', '.join(missing)}: tensor.record_stream and "
            "torch.cuda.empty_cache could not reach gpupool (a newer PyTorch has them)"
        )
    _native._capi_configure("cuda", text)
    library = ctypes.CDLL(_native.__file__)
    for setter, symbol in HOOKS.items():
        getattr(native, setter)(ctypes.cast(getattr(library, symbol), ctypes.c_void_p).value)
    for setter, symbol in OPTIONAL_HOOKS.items():
        if callable(getattr(native, setter, None)):
            getattr(native, setter)(ctypes.cast(getattr(library, symbol), ctypes.c_void_p).value)
    change_current_allocator(allocator)


def memory_stats(device: int = 0) -> dict[str, int]:
    """The statistics of device ``device``'s pool (empty before its first allocation)."""
    return _native._capi_memory_stats(device) or {}


def empty_cache() -> int:
    """Returns every fully free cached segment to the driver; returns the bytes released."""
    return _native._capi_empty_cache()


def last_error() -> str | None:
    """Why this thread's latest allocation, free or record_stream through the hook failed
    (cleared by reading it; each thread has its own, as with ``cudaGetLastError``)."""
    return _native._capi_last_error()
