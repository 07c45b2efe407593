"""The stand-in's driver module: no NVIDIA binding, so pointers are ctypes integers."""

USE_NV_BINDING = False
