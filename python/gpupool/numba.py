"""Numba: an External Memory Management plugin that allocates device arrays from gpupool.

``numba.cuda.set_memory_manager(gpupool.numba.GpupoolMemoryManager)``, or set
``NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba`` before Numba starts. The class is built on first
access, so importing this module does not import Numba.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import weakref
from typing import Any

import gpupool

__all__ = ["GpupoolMemoryManager"]  # noqa: F822 - built on first access, by __getattr__

# The driver's handle for the legacy default stream (CU_STREAM_LEGACY).
CU_STREAM_LEGACY = 1
# Keys of the managers' allocation tables: never restarted, so a pointer made before a reset,
# finalized after the next initialize, cannot take a newer allocation's entry with it.
_allocation_keys = itertools.count()


def _device_pointer(address: int) -> Any:
    """The pointer type Numba's driver layer expects: the NVIDIA binding's, or ctypes'."""
    from numba.cuda.cudadrv import driver

    # numba-cuda always has the NVIDIA binding (and no flag); older Numba names it with a flag.
    if getattr(driver, "USE_NV_BINDING", hasattr(driver, "binding")):
        return driver.binding.CUdeviceptr(address)
    return ctypes.c_uint64(address)


def _address(memory: Any) -> int:
    """A Numba MemoryPointer's device address, with or without the NVIDIA binding."""
    pointer = memory.device_pointer
    return int(pointer) if not hasattr(pointer, "value") else int(pointer.value)


def _shared_pages_handle_class() -> type:
    """Numba's IpcHandle for shareable pages: pickled to the other process, opened there by
    duplicating the exporter's descriptors (gpupool._native._import_pages)."""
    from numba.cuda import MemoryPointer
    from numba.cuda.cudadrv.driver import IpcHandle

    class SharedPagesIpcHandle(IpcHandle):
        """Numba's IpcHandle for pages exported as file descriptors (``shareable_handle:posix_fd``)."""

        def __init__(self, base: Any, export: tuple, owner: bool):
            pid, pages, offset, size, device, source = export
            super().__init__(base, None, size, source_info=source, offset=offset)
            self.export, self._imported = export, None
            if owner:
                # The descriptors must outlive the pickling; they go when this handle does.
                weakref.finalize(self, _close_all, [fd for fd, *_ in pages])

        def __reduce__(self) -> tuple:
            return (_rebuild_shared_pages, (self.export,))

        def open(self, context: Any) -> MemoryPointer:
            """Maps the exported pages in ``context`` and returns a MemoryPointer to the bytes; a context on
            another GPU than the exporter's is a ValueError."""
            pid, pages, offset, size, _, source = self.export
            # Device numbers differ between processes (CUDA_VISIBLE_DEVICES); identities do not.
            if source != context.device.get_device_identity():
                raise ValueError(
                    "these pages live on another GPU than the receiving context's: open the handle in a context "
                    "on the exporting device"
                )
            self._imported = gpupool._native._import_pages(context.device.id, pid, pages)
            address = self._imported.base + offset
            return MemoryPointer(context, _device_pointer(address), size, finalizer=self._imported.close)

        def close(self) -> None:
            """Unmaps the pages ``open`` mapped, if any."""
            if self._imported is not None:
                self._imported.close()
                self._imported = None

    return SharedPagesIpcHandle


def shared_pages_handle(base: Any, export: tuple, owner: bool = True) -> Any:
    """An IpcHandle for pages exported as ``export`` = (pid, [(fd, size, st_dev, st_ino)], offset,
    size, device, source identity); the exporting process owns (and eventually closes) the
    descriptors."""
    return _shared_pages_handle_class()(base, export, owner)


def _rebuild_shared_pages(export: tuple) -> Any:
    return shared_pages_handle(None, export, owner=False)


def _close_all(fds: list[int]) -> None:
    """Closes every descriptor, then raises the first failure: one must not keep the rest open."""
    failure = None
    for fd in fds:
        try:
            os.close(fd)
        except OSError as e:
            failure = failure or e
    if failure is not None:
        raise failure


def _build() -> type:
    from numba.cuda import GetIpcHandleMixin, HostOnlyCUDAMemoryManager, MemoryPointer

    class GpupoolMemoryManager(GetIpcHandleMixin, HostOnlyCUDAMemoryManager):
        """Device memory from one gpupool pool per Numba context; host memory as Numba does it.

        A freed array's memory is reused once the work queued before the free on the legacy
        stream and every blocking stream (Numba's streams are blocking) has finished, as after
        Numba's own deferred ``cuMemFree``: it waits for an event on the legacy stream, which
        completes only after that work.
        """

        pool: Any = None

        def initialize(self) -> None:
            """Opens the context's pool on the first call; later calls keep it and its cache."""
            # Numba calls this whenever it readies the context, often many times: the pool and
            # its cache stay (Numba's plugin contract: previous state must not be invalidated).
            if self.pool is None:
                self.pool = gpupool.Pool(f"cuda:{self.context.device.id}")
                self._legacy = self.pool.external_stream(CU_STREAM_LEGACY)

        def memalloc(self, size: int) -> MemoryPointer:
            """``size`` bytes from the pool, freed (after the legacy stream's queued work) when Numba finalizes the
            pointer. A request the device cannot serve raises ``gpupool.OutOfMemoryError``."""
            ptr = self.pool.alloc(size)
            # Keyed by a counter: every zero-byte allocation has address 0, and an id() can be
            # reused by a pointer allocated after a reset.
            key = next(_allocation_keys)
            self.allocations[key] = ptr
            allocations, legacy = self.allocations, self._legacy

            def finalize() -> None:
                # After a context reset the table is already empty; the pointer went with it.
                freed = allocations.pop(key, None)
                if freed is not None:
                    try:
                        freed.record_stream(legacy)
                    except (RuntimeError, ValueError):
                        # Without the wait the memory could be reused under running work.
                        legacy.synchronize()

            return MemoryPointer(self.context, _device_pointer(ptr.ptr), size, finalizer=finalize)

        def get_memory_info(self) -> Any:
            """The device's free and total bytes as the driver counts them, as Numba's own manager reports
            them: memory the pool caches counts as used (it is, for every other allocator on the device)."""
            from numba.cuda import MemoryInfo

            free, total = gpupool.cuda_mem_get_info(self.context.device.id)
            return MemoryInfo(free=free, total=total)

        def get_ipc_handle(self, memory: MemoryPointer) -> Any:
            """An IpcHandle that opens ``memory`` in another process: its pages' descriptors with
            ``shareable_handle:posix_fd``, else a CUDA IPC handle. Memory that has neither raises."""
            address = _address(memory)
            if self.pool.config["shareable_handle"] == "posix_fd":
                # Pages made shareable travel as file descriptors, one per physical allocation.
                # Only the handle closes them, so whatever can fail is looked up first.
                device, source = self.context.device.id, self.context.device.get_device_identity()
                pid, pages, offset = gpupool._native._export_pages(self.pool, address, memory.size)
                try:
                    return shared_pages_handle(memory, (pid, pages, offset, memory.size, device, source))
                except BaseException:
                    _close_all([fd for fd, *_ in pages])
                    raise
            # A CUDA IPC handle exists for the pool's cuMemAlloc segments (strategies with plain
            # segments, such as strategy:pytorch); gpupool says clearly when the memory has none,
            # then Numba's own mixin builds the IpcHandle its receiving side opens.
            gpupool._native._ipc_handle(self.pool, address)
            return GetIpcHandleMixin.get_ipc_handle(self, memory)

        def reset(self) -> None:
            """Resets what Numba's host-only manager holds, then returns the pool's cached segments to the device
            and drops the pool; the next ``initialize`` opens a new one."""
            # Numba may reset before initializing. A reset of the device (numba.cuda.close())
            # resets its primary context next, under this pool: the pool goes, and the next
            # initialize opens a new one.
            super().reset()
            if self.pool is not None:
                self.pool.empty_cache()
                self.pool = self._legacy = None

        @property
        def interface_version(self) -> int:
            """The version of Numba's External Memory Management interface implemented: 1."""
            return 1

    return GpupoolMemoryManager


def __getattr__(name: str) -> Any:
    # `_numba_memory_manager` is the name Numba's NUMBA_CUDA_MEMORY_MANAGER variable looks up.
    if name in ("GpupoolMemoryManager", "_numba_memory_manager"):
        try:
            cls = _build()
        except ImportError as e:
            # As for any absent attribute (hasattr() stays usable), saying why it is absent.
            raise AttributeError(f"gpupool.numba.{name} needs Numba: {e}") from e
        globals().update(GpupoolMemoryManager=cls, _numba_memory_manager=cls)
        return cls
    raise AttributeError(f"module 'gpupool.numba' has no attribute {name!r}")
