"""Eight threads allocating and freeing on one host pool: no torn state, no shared blocks."""

from __future__ import annotations

import random
import threading
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
