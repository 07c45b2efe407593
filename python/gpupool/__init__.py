"""gpupool: a caching device-memory pool with PyTorch-compatible statistics."""

from importlib.metadata import version

from gpupool import _native
from gpupool._native import Device, DevicePtr, OutOfMemoryError
from gpupool._summary import format_memory_summary

__all__ = ["Device", "DevicePtr", "OutOfMemoryError", "Pool", "format_memory_summary"]
__version__ = version("gpupool")


class Pool(_native.Pool):
    """A caching pool over one device (``"host"`` or ``"sim"``), following PyTorch's rules."""

    __slots__ = ()

    def memory_summary(self, abbreviated: bool = False) -> str:
        """The statistics as a table laid out like ``torch.cuda.memory_summary``."""
        return format_memory_summary(self.memory_stats(), abbreviated, device=self.device)

    def __repr__(self) -> str:
        return (
            f"gpupool.Pool(device={self.device!r}, capacity={self.capacity!r}, "
            f"allocated={self.memory_allocated()}, reserved={self.memory_reserved()})"
        )
