"""A stand-in for the parts of CuPy gpupool.cupy touches (the interface, not CuPy).

`cupy.cuda.Device(n).use()` sets the current device, `cupy.cuda.Stream` objects with a `ptr`
become current with `use()` (and destroy their handle when they die, if told how), `UnownedMemory`
/ `MemoryPointer` keep their owner as CuPy's do, and `cupy.cuda.memory.OutOfMemoryError` takes
CuPy's arguments.
"""

from cupy import cuda  # noqa: F401
