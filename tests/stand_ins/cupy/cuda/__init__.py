"""The stand-in's `cupy.cuda` (see `cupy/__init__.py`)."""

from cupy.cuda import memory  # noqa: F401

_state = {"device": 0, "stream": None}


class Device:
    def __init__(self, device=None):
        self.id = _state["device"] if device is None else device

    def use(self):
        _state["device"] = self.id


class Stream:
    """A stream with a raw handle; given `destroy`, it destroys the handle when it dies, as
    CuPy's streams do in `__del__`."""

    null = None

    def __init__(self, ptr, destroy=None):
        self.ptr, self._destroy = ptr, destroy

    def use(self):
        _state["stream"] = self

    def __del__(self):
        if self._destroy is not None:
            self._destroy(self.ptr)


Stream.null = Stream(0)


def get_current_stream():
    return _state["stream"] or Stream.null


class UnownedMemory:
    def __init__(self, ptr, size, owner, device_id):
        self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id


class MemoryPointer:
    def __init__(self, mem, offset):
        self.mem, self.ptr = mem, mem.ptr + offset
