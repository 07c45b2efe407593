"""Eight threads allocating and freeing on one host pool: no torn state, no shared blocks."""

from __future__ import annotations

import random
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
