"""Statistics against PyTorch's accounting (c10/cuda/CUDACachingAllocator.cpp): which operation
moves which counter, and by how much."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import gpupool
from pool_checks import EXAMPLES_SCALE, POOL_KINDS, STRATEGIES, MiB

INACTIVE = ("inactive_split", "inactive_split_bytes")


def totals(pool, names=INACTIVE) -> dict[str, int]:
    stats = pool.memory_stats()
    return {f"{n}.{k}.{f}": stats[f"{n}.{k}.{f}"] for n in names for k in POOL_KINDS for f in ("allocated", "freed")}


def test_inactive_split_totals_follow_pytorch_on_a_small_segment():
    # PyTorch's alloc_found_block: shrinking an already split free block decreases its bytes,
    # it does not remove one block and add another; free_block applies the net change of a
    # free and its merges once.
    pool = gpupool.Pool("sim", capacity="1GiB", config="strategy:pytorch")
    a = pool.alloc(512)  # the fresh 2 MiB segment splits: a new inactive split block
    b = pool.alloc(512)  # that block shrinks by 512 B
    a.free()  # a is a free piece of a split segment: +1 block, +512 B
    b.free()  # b merges with a and the tail: the segment is whole, no inactive split left
    tail = 2 * MiB - 1024
    assert totals(pool) == {
        "inactive_split.all.allocated": 2,
        "inactive_split.all.freed": 2,
        "inactive_split.small_pool.allocated": 2,
        "inactive_split.small_pool.freed": 2,
        "inactive_split.large_pool.allocated": 0,
        "inactive_split.large_pool.freed": 0,
        "inactive_split_bytes.all.allocated": 2 * MiB,
        "inactive_split_bytes.all.freed": 512 + 512 + tail,
        "inactive_split_bytes.small_pool.allocated": 2 * MiB,
        "inactive_split_bytes.small_pool.freed": 512 + 512 + tail,
        "inactive_split_bytes.large_pool.allocated": 0,
        "inactive_split_bytes.large_pool.freed": 0,
    }


SIZES = st.one_of(st.integers(1, 64 * 1024), st.integers(1, 3 * MiB), st.integers(1, 24 * MiB))
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), SIZES),
        st.tuples(st.just("free"), st.integers(0, 1 << 16)),
    ),
    max_size=40,
)


@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=40 * EXAMPLES_SCALE)
@given(ops=OPS)
def test_inactive_split_totals_sum_each_operations_net_change(strategy, ops):
    # Every alloc and free on one stream is one change of the inactive-split counters in
    # PyTorch, applied as a net increase or decrease: `allocated` grows by exactly the rise of
    # `current` and `freed` by its fall.
    pool = gpupool.Pool("sim", capacity="4GiB", config=f"strategy:{strategy}")
    live = []
    expected = totals(pool)
    stats = pool.memory_stats()
    for op, arg in ops:
        if op == "alloc":
            live.append(pool.alloc(arg))
        elif live:
            live.pop(arg % len(live)).free()
        after = pool.memory_stats()
        for name in INACTIVE:
            for kind in POOL_KINDS:
                key = f"{name}.{kind}."
                change = after[key + "current"] - stats[key + "current"]
                expected[key + "allocated"] += max(change, 0)
                expected[key + "freed"] += max(-change, 0)
        assert totals(pool) == expected, (op, arg)
        stats = after


def test_a_pending_free_keeps_its_request_counted_until_it_completes():
    # PyTorch decreases requested_bytes in free_block, with active_bytes: a block whose free
    # waits on another stream's events is still active, request included, and the snapshot's
    # segment requested_size sums the requests of active blocks.
    pool = gpupool.Pool("sim", capacity="1GiB", config="strategy:pytorch")
    side = pool.stream()
    ptr = pool.alloc(1000)
    ptr.record_stream(side)
    side.hold()
    ptr.free()
    stats = pool.memory_stats()
    assert stats["allocated_bytes.all.current"] == 0
    assert stats["active_bytes.all.current"] == 1024
    assert stats["requested_bytes.all.current"] == 1000
    assert stats["requested_bytes.all.freed"] == 0
    (segment,) = pool.snapshot()["segments"]
    assert segment["requested_size"] == 1000
    assert segment["blocks"][0]["state"] == "active_pending_free"
    assert segment["blocks"][0]["requested_size"] == 1000
    side.synchronize()
    pool.synchronize()
    stats = pool.memory_stats()
    assert stats["active_bytes.all.current"] == 0
    assert stats["requested_bytes.all.current"] == 0
    assert stats["requested_bytes.all.freed"] == 1000
    assert pool.snapshot()["segments"][0]["requested_size"] == 0


def test_oversize_counters_follow_max_split_size():
    # PyTorch: an allocation of a block >= max_split_size counts in oversize_allocations until
    # its free is requested; a cudaMalloc'd segment that big in oversize_segments until
    # released.
    pool = gpupool.Pool("sim", capacity="1GiB", config="strategy:pytorch,max_split_size_mb:40")
    big = pool.alloc(64 * MiB)
    small = pool.alloc(8 * MiB)  # a 20 MiB segment, split: neither is oversize
    stats = pool.memory_stats()
    assert (stats["oversize_allocations.current"], stats["oversize_segments.current"]) == (1, 1)
    assert (
        "|       1    |       1    |       1    |       0    |"
        in pool.memory_summary().split("Oversize allocations")[1]
    )
    big.free()
    small.free()
    stats = pool.memory_stats()
    assert (stats["oversize_allocations.current"], stats["oversize_allocations.freed"]) == (0, 1)
    assert stats["oversize_segments.current"] == 1  # cached
    pool.reset_peak_memory_stats()
    pool.empty_cache()
    stats = pool.memory_stats()
    assert stats["oversize_allocations.peak"] == 0
    assert (stats["oversize_segments.current"], stats["oversize_segments.peak"]) == (0, 1)
    assert (stats["oversize_segments.allocated"], stats["oversize_segments.freed"]) == (1, 1)


@pytest.mark.parametrize(
    ("config", "reported"),
    [
        ("strategy:pytorch", -1),  # unset: PyTorch's SIZE_MAX, read as a signed count
        ("strategy:pytorch,max_split_size_mb:40", 40 * MiB),
        ("strategy:default,max_split_size_mb:300", 300 * MiB),
        ("strategy:bfc", -1),
    ],
)
def test_max_split_size_is_reported_as_pytorch_does(config, reported):
    pool = gpupool.Pool("sim", capacity="1GiB", config=config)
    assert pool.memory_stats()["max_split_size"] == reported


def test_without_max_split_size_nothing_is_oversize():
    pool = gpupool.Pool("sim", capacity="1GiB", config="strategy:pytorch")
    pool.alloc(512 * MiB)
    stats = pool.memory_stats()
    assert stats["oversize_allocations.allocated"] == stats["oversize_segments.allocated"] == 0


def test_num_sync_all_streams_counts_empty_cache_and_the_out_of_memory_path():
    # PyTorch's synchronize_and_free_events, called by release_cached_blocks: emptyCache and
    # the out-of-memory path's last retry; a plain synchronize does not count.
    pool = gpupool.Pool("sim", capacity="64MiB", config="strategy:pytorch")
    assert pool.memory_stats()["num_sync_all_streams"] == 0
    pool.synchronize()
    pool.empty_cache()
    assert pool.memory_stats()["num_sync_all_streams"] == 1
    held = pool.alloc(40 * MiB)
    with pytest.raises(gpupool.OutOfMemoryError):
        pool.alloc(40 * MiB)
    stats = pool.memory_stats()
    assert (stats["num_sync_all_streams"], stats["num_alloc_retries"], stats["num_ooms"]) == (2, 1, 1)
    held.free()


ACCUMULATED_EVENTS = (
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
    "num_device_map",
    "num_device_unmap",
    "num_driver_calls",
)


@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=25 * EXAMPLES_SCALE, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 48 * MiB)), max_size=40),
    reset_at=st.integers(0, 40),
)
def test_reset_accumulated_restarts_the_sums_and_counts(strategy, ops, reset_at):
    # Two pools run the same program; one resets its accumulated statistics part way. Its sums
    # and counts must be what the other's grew by since then, its current values and peaks the
    # other's (PyTorch's resetAccumulatedStats).
    # BFC and the arena refuse a split limit.
    limit = "" if strategy in ("bfc", "arena") else ",max_split_size_mb:40"
    config = f"strategy:{strategy}{limit}"
    reset, kept = (gpupool.Pool("sim", capacity="256MiB", config=config) for _ in range(2))
    live: dict[gpupool.Pool, list] = {reset: [], kept: []}
    at_reset = kept.memory_stats()
    for step, (allocate, size) in enumerate(ops):
        if step == reset_at:
            reset.reset_accumulated_memory_stats()
            at_reset = kept.memory_stats()
        for pool in (reset, kept):
            if allocate or not live[pool]:
                try:
                    live[pool].append(pool.alloc(size))
                except gpupool.OutOfMemoryError:
                    pass
            else:
                live[pool].pop(size % len(live[pool])).free()
        if step % 8 == 7:
            reset.empty_cache()
            kept.empty_cache()
    if reset_at >= len(ops):
        reset.reset_accumulated_memory_stats()
        at_reset = kept.memory_stats()
    ours, theirs = reset.memory_stats(), kept.memory_stats()
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        if key.endswith((".allocated", ".freed")) or key in ACCUMULATED_EVENTS or key.startswith("num_driver_"):
            assert value == theirs[key] - at_reset[key], key
        else:
            assert value == theirs[key], key
    reset.check_invariants()
