"""The stand-in's `cupy.cuda.memory`: CuPy's out-of-memory error, with CuPy's constructor."""


class OutOfMemoryError(MemoryError):
    def __init__(self, size, total, limit=0):
        self._size, self._total, self._limit = size, total, limit
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes).")
