"""The stand-in's `cupy.cuda` (see `cupy/__init__.py`)."""

_state = {"device": 0, "stream": 0}


class Device:
    def __init__(self, device=None):
        self.id = _state["device"] if device is None else device

    def use(self):
        _state["device"] = self.id


class Stream:
    def __init__(self, ptr):
        self.ptr = ptr

    def use(self):
        _state["stream"] = self.ptr


def get_current_stream():
    return Stream(_state["stream"])


class UnownedMemory:
    def __init__(self, ptr, size, owner, device_id):
        self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id


class MemoryPointer:
    def __init__(self, memory, offset):
        self.mem, self.ptr = memory, memory.ptr + offset
