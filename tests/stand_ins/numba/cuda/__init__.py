"""The stand-in's `numba.cuda` (see `numba/__init__.py`)."""

from collections import namedtuple

MemoryInfo = namedtuple("MemoryInfo", "free total")


class _Device:
    def __init__(self, id):
        self.id = id

    def get_device_identity(self):
        return {"pci_domain_id": 0, "pci_bus_id": self.id, "pci_device_id": 0}


class _Context:
    def __init__(self, device):
        self.device = _Device(device)


class HostOnlyCUDAMemoryManager:
    def __init__(self, context):
        self.context = context
        self.allocations = {}

    def reset(self):
        self.allocations.clear()


class GetIpcHandleMixin:
    """Numba's default get_ipc_handle builds an IpcHandle from cuIpcGetMemHandle; here, a tuple."""

    def get_ipc_handle(self, memory):
        return ("ipc handle", memory.size)


class MemoryPointer:
    def __init__(self, context, pointer, size, finalizer=None):
        self.context, self.device_pointer, self.size, self._finalizer = context, pointer, size, finalizer

    def free(self):
        if self._finalizer:
            self._finalizer()


def context_for(device):
    """Stand-in only: the context Numba would hand the plugin for `device`."""
    return _Context(device)
