"""The stand-in's `torch.cuda.memory`: a pluggable allocator that records what it is given."""

import ctypes
import os

current = None


class _NativeAllocator:
    """The object `CUDAPluggableAllocator.allocator()` returns; its setters store addresses."""

    def __init__(self):
        self.hooks = {}
        if not os.environ.get("STAND_IN_TORCH_WITHOUT_HOOKS"):
            for name in ("set_init_fn", "set_reset_fn", "set_memory_fraction_fn", "set_record_stream_fn"):
                if name == "set_memory_fraction_fn" and os.environ.get("STAND_IN_TORCH_WITHOUT_FRACTION"):
                    continue
                setattr(self, name, lambda address, name=name: self.hooks.__setitem__(name, address))


class CUDAPluggableAllocator:
    def __init__(self, path_to_so_file, alloc_fn_name, free_fn_name):
        library = ctypes.CDLL(path_to_so_file)
        self.alloc = ctypes.cast(getattr(library, alloc_fn_name), ctypes.c_void_p).value
        self.free = ctypes.cast(getattr(library, free_fn_name), ctypes.c_void_p).value
        self._allocator = _NativeAllocator()

    def allocator(self):
        return self._allocator


def change_current_allocator(allocator):
    global current
    current = allocator
