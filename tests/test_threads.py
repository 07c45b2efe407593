"""Eight threads allocating and freeing on one host pool: no torn state, no shared blocks."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import gpupool
from pool_checks import KiB, MiB, check_pool, drain, stamp, verify

THREADS = 8
OPERATIONS = 20_000
# Patterns at both ends of each allocation are enough to catch two threads sharing a block.
PATTERN_SPAN = 16


def _random_size(rng: random.Random) -> int:
    # Mostly small-pool requests, where threads contend for the same segments, some large ones.
    return rng.randint(1, 64 * KiB) if rng.random() < 0.95 else rng.randint(MiB, 12 * MiB)


def _worker(pool, thread: int, start: threading.Barrier) -> int:
    """Runs the thread's random program; returns how many allocations it made."""
    rng = random.Random(thread)
    allocations = 0
    live: list[tuple[gpupool.DevicePtr, int]] = []
    start.wait()
    for step in range(OPERATIONS):
        if live and (len(live) >= 64 or rng.random() < 0.5):
            ptr, tag = live.pop(rng.randrange(len(live)))
            verify(ptr, tag, PATTERN_SPAN)
            ptr.free()
        else:
            ptr = pool.alloc(_random_size(rng))
            tag = thread * OPERATIONS + step
            stamp(ptr, tag, PATTERN_SPAN)
            live.append((ptr, tag))
            allocations += 1
    for ptr, tag in live:
        verify(ptr, tag, PATTERN_SPAN)
        ptr.free()
    return allocations


def test_threads_share_one_pool():
    pool = gpupool.Pool("host")
    start = threading.Barrier(THREADS)
    with ThreadPoolExecutor(THREADS) as executor:
        futures = [executor.submit(_worker, pool, thread, start) for thread in range(THREADS)]
        allocations = sum(future.result() for future in futures)
    check_pool(pool, [])
    assert pool.memory_stats()["allocation.all.allocated"] == allocations
    drain(pool, [])


def _device_caller(pool, thread: int, start: threading.Barrier, steps: int) -> int:
    """Allocates, frees and now and then gives memory back (a device call made with the GIL
    released and the pool locked); returns how many times it gave memory back."""
    rng = random.Random(1000 + thread)
    live: list[tuple[gpupool.DevicePtr, int]] = []
    returns = 0
    start.wait()
    for step in range(steps):
        roll = rng.random()
        if roll < 0.05:
            pool.empty_cache()
            returns += 1
        elif live and (len(live) >= 32 or roll < 0.5):
            ptr, tag = live.pop(rng.randrange(len(live)))
            verify(ptr, tag, PATTERN_SPAN)
            ptr.free()
        else:
            ptr = pool.alloc(rng.choice([4 * KiB, 300 * KiB, 3 * MiB, 9 * MiB]) + rng.randrange(4096))
            stamp(ptr, thread * steps + step, PATTERN_SPAN)
            live.append((ptr, thread * steps + step))
    for ptr, tag in live:
        verify(ptr, tag, PATTERN_SPAN)
        ptr.free()
    return returns


def test_device_calls_interleave_with_cached_calls():
    """While one thread holds the pool over a device call (`empty_cache` unmaps pages with the
    GIL released), the others wait for it: no block is shared, none is lost."""
    pool = gpupool.Pool("host")
    start = threading.Barrier(4)
    returns: list[int] = []
    # Daemon threads with a deadline: a lock left held by nobody keeps its waiters waiting (with
    # the GIL released), and the test then fails in a minute instead of hanging.
    threads = [
        threading.Thread(target=lambda t=t: returns.append(_device_caller(pool, t, start, 2_000)), daemon=True)
        for t in range(4)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a thread is still waiting for the pool"
    assert len(returns) == 4 and sum(returns) > 0
    check_pool(pool, [])
    drain(pool, [])


# Threads allocating through the C ABI while others reconfigure its pools. An allocation must
# never land in a pool that `configure` is replacing: that pool is dropped, and the pointer with
# it (the threads write every byte, so a dangling pointer crashes the child).
C_ABI_RACE = """
import ctypes, sys, threading, time
from gpupool import _native
sys.setswitchinterval(1e-6)
lib = ctypes.CDLL(_native.__file__)
lib.gpupool_alloc.restype = ctypes.c_void_p
lib.gpupool_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.gpupool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
_native._capi_configure("host", "strategy:direct")
stop, foreign = False, 0
def allocate():
    global foreign
    while not stop:
        p = lib.gpupool_alloc(1 << 20, 0, None)
        if p:
            ctypes.memset(p, 0xAB, 1 << 20)
            lib.gpupool_free(p, 1 << 20, 0, None)
            foreign += "not a live allocation" in (_native._capi_last_error() or "")
def configure():
    while not stop:
        try:
            _native._capi_configure("host", "strategy:direct")
        except RuntimeError:
            pass  # refused while allocations are live, as it should be
threads = [threading.Thread(target=allocate) for _ in range(6)] + [threading.Thread(target=configure) for _ in range(2)]
for t in threads:
    t.start()
time.sleep(2)
stop = True
for t in threads:
    t.join()
print(foreign)
"""


def test_c_abi_allocations_never_land_in_a_pool_being_replaced():
    done = subprocess.run([sys.executable, "-c", C_ABI_RACE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the child died ({done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.strip() == "0", "frees of pointers from a replaced pool"
