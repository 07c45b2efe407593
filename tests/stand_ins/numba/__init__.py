"""A stand-in for the parts of Numba's External Memory Management interface gpupool.numba uses
(the interface, not Numba): a base manager with an `allocations` table and a context."""
