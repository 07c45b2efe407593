"""The stand-in's driver module: no NVIDIA binding, so pointers are ctypes integers."""

USE_NV_BINDING = False


class IpcHandle:
    """Numba's IpcHandle constructor, which subclasses call."""

    def __init__(self, base, handle, size, source_info=None, offset=0):
        self.base, self.handle, self.size, self.source_info, self.offset = base, handle, size, source_info, offset
