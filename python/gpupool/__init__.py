"""gpupool: a caching device-memory pool with PyTorch-compatible statistics."""

import os
import warnings
from importlib.metadata import version

from gpupool import _native
from gpupool._advice.advice import Advice
from gpupool._advice.advice import schema as advise_schema
from gpupool._advice.analysis import advise, advise_each
from gpupool._native import (
    Device,
    DevicePtr,
    OutOfMemoryError,
    Stream,
    cuda_available,
    cuda_mem_get_info,
    device_count,
)
from gpupool._summary import format_memory_summary
from gpupool._view import View
from gpupool.trace import ReplayResult, Trace, replay

__all__ = [
    "Advice",
    "Device",
    "DevicePtr",
    "OutOfMemoryError",
    "Pool",
    "ReplayResult",
    "Stream",
    "Trace",
    "View",
    "advise",
    "advise_each",
    "advise_schema",
    "cuda_available",
    "cuda_mem_get_info",
    "device_count",
    "format_memory_summary",
    "replay",
    "trace",
]
__version__ = version("gpupool")


class Pool(_native.Pool):
    """A caching pool over one device (``"host"``, ``"sim"`` or ``"cuda:N"``).

    ``config`` is a ``PYTORCH_CUDA_ALLOC_CONF``-style string, such as
    ``"strategy:bfc,release_threshold:0.2"``; without one, the ``GPUPOOL_ALLOC_CONF`` environment
    variable applies, else PyTorch's rules.
    """

    __slots__ = ()

    def memory_summary(self, abbreviated: bool = False) -> str:
        """The statistics as a table laid out like ``torch.cuda.memory_summary``."""
        return format_memory_summary(self.memory_stats(), abbreviated, device=self.device)

    def dump_trace(self, path: str | os.PathLike[str]) -> None:
        """Writes the recorded history as an RMM logging CSV (gzip if ``path`` ends in .gz).
        RMM's log has no word for releases of cached memory (``empty_cache()`` calls, the
        out-of-memory path's): they are left out, and a warning says how many."""
        left_out = super().dump_trace(path)
        if left_out:
            warnings.warn(
                f"{os.fspath(path)}: {left_out} release{'s' * (left_out != 1)} of cached memory left out"
                " (RMM's CSV cannot say them)",
                stacklevel=2,
            )

    def __repr__(self) -> str:
        return (
            f"gpupool.Pool(device={self.device!r}, capacity={self.capacity!r}, "
            f"allocated={self.memory_allocated()}, reserved={self.memory_reserved()})"
        )
