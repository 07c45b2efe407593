"""A gpupool pool over host memory, read and written through NumPy without copies.

It allocates from a ``host`` pool, views the bytes as float32 with ``ptr.view`` and as raw bytes
with ``numpy.asarray(ptr)``, writes through one and reads through the other, frees, and shows
that the freed block stays cached for the next request until ``empty_cache()``.

    python examples/pool_numpy.py
"""

import numpy as np

import gpupool

MiB = 1 << 20
pool = gpupool.Pool("host")  # no config: GPUPOOL_ALLOC_CONF if set, else gpupool's default strategy
print(f"pool on {pool.device}, strategy {pool.config['strategy']}")

with pool.alloc(4 * MiB) as ptr:  # a DevicePtr, freed when the block ends
    matrix = np.asarray(ptr.view("float32", (1024, 1024)))  # zero-copy; the view pins the bytes
    matrix[:] = np.arange(1024, dtype=np.float32)  # each row counts 0..1023
    raw = np.asarray(ptr)  # the same bytes as uint8
    print(f"allocated {ptr.size:,} bytes at {ptr.ptr:#x}, {ptr.exports} live exports")
    print("row 3 starts", matrix[3, :4], "; its 1.0 as bytes:", raw[3 * 4096 + 4 : 3 * 4096 + 8])
    ptr.copy_from_host(np.full(4, 7.5, dtype=np.float32).tobytes())  # a copy in, seen by the view
    print("after copy_from_host:", matrix[0, :6])
    print(f"allocated {pool.memory_allocated() // MiB} MiB, reserved {pool.memory_reserved() // MiB} MiB")
    del matrix, raw  # views pin their bytes even past the free: drop them first

print(f"after the free: allocated {pool.memory_allocated()} B, reserved {pool.memory_reserved() // MiB} MiB")
again = pool.alloc(3 * MiB)  # served from the cached segment: no new device memory
maps = pool.memory_stats()["num_device_map"]
print(f"a second allocation ({again.size // MiB} MiB) reused the cached pages: {maps} map call in all")
again.free()
pool.empty_cache()  # fully free segments go back to the device
print(f"after empty_cache: reserved {pool.memory_reserved()} B")
print("\n".join(pool.memory_summary(abbreviated=True).splitlines()[:12]))
