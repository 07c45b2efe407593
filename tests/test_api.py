"""The documented Python API, and PyTorch's caching rules as seen through it."""

from __future__ import annotations

import numpy as np
import pytest

import gpupool
from gpupool import _native
from pool_checks import (
    BLOCK_KEYS,
    FIELDS,
    POOL_KINDS,
    SEGMENT_KEYS,
    STAT_NAMES,
    KiB,
    MiB,
    check_pool,
)

SUMMARY_ROWS = (
    "Allocated memory",
    "Active memory",
    "Requested memory",
    "GPU reserved memory",
    "Non-releasable memory",
    "Allocations",
    "Active allocs",
    "GPU reserved segments",
    "Non-releasable allocs",
    "Oversize allocations",
    "Oversize GPU segments",
)


@pytest.fixture
def pool():
    """PyTorch's rules, which most examples here check (the default strategy differs)."""
    return gpupool.Pool("host", config="strategy:pytorch")


def segments_of(pool) -> list[dict]:
    return sorted(pool.snapshot()["segments"], key=lambda s: s["address"])


def test_package_surface():
    assert gpupool.__version__ == "0.1.0"
    assert issubclass(gpupool.Pool, _native.Pool)
    assert issubclass(gpupool.OutOfMemoryError, MemoryError)
    assert set(gpupool.__all__) <= set(dir(gpupool))


def test_pool_properties_and_repr():
    pool = gpupool.Pool("sim", capacity="512MiB")
    assert pool.device == "sim"
    assert pool.capacity == 512 * MiB
    assert "sim" in repr(pool)
    assert gpupool.Pool().device == ("cuda:0" if gpupool.cuda_available() else "host")
    assert gpupool.Pool().capacity is None


@pytest.mark.parametrize(
    ("capacity", "size"),
    [
        (4096, 4096),
        ("80GiB", 80 << 30),
        ("512MiB", 512 * MiB),
        ("1.5GB", 1_500_000_000),
        ("4096.0", 4096),
        ("0.5MiB", 512 * KiB),
        ("64KiB", 64 * KiB),
    ],
)
def test_capacity_accepts_bytes_and_units(capacity, size):
    # PyTorch's segments: a device of 4 KiB holds no page of the paged strategies.
    assert gpupool.Pool("sim", capacity=capacity, config="strategy:pytorch").capacity == size


def test_pointer_attributes(pool):
    ptr = pool.alloc(1000)
    assert ptr.ptr == int(ptr)
    assert ptr.size == 1000
    assert ptr.device == "host"
    assert not ptr.freed
    pool.free(ptr)
    assert ptr.freed


def test_numpy_view_is_zero_copy(pool):
    ptr = pool.alloc(3000)
    view = np.asarray(ptr)
    assert view.dtype == np.uint8 and view.shape == (3000,)
    assert view.__array_interface__["data"][0] == ptr.ptr
    view[:] = np.arange(3000) % 251
    assert ptr.copy_to_host() == view.tobytes()
    ptr.copy_from_host(b"\xff" * 10, offset=100)
    assert (view[100:110] == 255).all()


def test_copy_from_host_takes_any_buffer(pool):
    ptr = pool.alloc(8)
    ptr.copy_from_host(np.arange(2, dtype=np.uint32))
    ptr.copy_from_host(bytearray(b"\x09\x09"), offset=6)
    assert ptr.copy_to_host() == b"\x00\x00\x00\x00\x01\x00\x09\x09"


def test_memory_stats_has_pytorchs_keys(pool):
    stats = pool.memory_stats()
    for name in STAT_NAMES:
        for kind in POOL_KINDS:
            for field in FIELDS:
                assert f"{name}.{kind}.{field}" in stats
    for key in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free"):
        assert key in stats
    assert all(isinstance(value, int) for value in stats.values())


def test_freed_counts_every_decrease(pool):
    # `freed` is derived from allocated - current; this pins it to PyTorch's meaning.
    sizes = [4096, 3 * MiB, 512, 70 * 1024]
    ptrs = [pool.alloc(n) for n in sizes]
    for ptr in ptrs[:3]:
        ptr.free()
    stats = pool.memory_stats()
    assert stats["allocation.all.allocated"] == 4 and stats["allocation.all.freed"] == 3
    assert stats["requested_bytes.all.freed"] == sum(sizes[:3])
    assert stats["requested_bytes.all.allocated"] - stats["requested_bytes.all.freed"] == sizes[3]
    # Under PyTorch's rules each of these requests gets a block of exactly its rounded size.
    assert stats["allocated_bytes.all.freed"] == 4096 + 3 * MiB + 512


def test_memory_summary_lays_out_pytorchs_rows(pool):
    ptr = pool.alloc(3 * MiB)
    summary = pool.memory_summary()
    lines = summary.splitlines()
    assert all(len(line) == 77 for line in lines)
    assert "gpupool" in lines[1]
    assert "OOMs" in summary and "retries" in summary
    for row in SUMMARY_ROWS:
        assert f"| {row} " in summary
    assert summary.count("from large pool") == 9
    assert "from large pool" not in pool.memory_summary(abbreviated=True)
    assert "| GPU reserved memory   |  20480 KiB |  20480 KiB |  20480 KiB |      0 B   |" in summary
    ptr.free()


def test_snapshot_has_pytorchs_keys(pool):
    ptr = pool.alloc(1000)
    snapshot = pool.snapshot()
    assert {"segments", "device_traces", "allocator_settings"} <= snapshot.keys()
    assert snapshot["device_traces"] == [[]]
    [segment] = snapshot["segments"]
    assert SEGMENT_KEYS <= segment.keys()
    assert segment["segment_type"] == "small"
    for block in segment["blocks"]:
        assert BLOCK_KEYS <= block.keys()
    [in_use] = [b for b in segment["blocks"] if b["state"] == "active_allocated"]
    assert (in_use["address"], in_use["size"], in_use["requested_size"]) == (ptr.ptr, 1024, 1000)
    assert {b["state"] for b in segment["blocks"]} == {"active_allocated", "inactive"}


def test_mid_sized_request_reserves_a_20_mib_segment(pool):
    ptr = pool.alloc(3 * MiB // 2)
    assert pool.memory_reserved() == 20 * MiB
    assert pool.memory_allocated() == 3 * MiB // 2
    check_pool(pool, [ptr])


def test_large_request_rounds_to_2_mib_and_takes_the_whole_segment(pool):
    ptr = pool.alloc(11 * MiB + 1)
    assert pool.memory_reserved() == 12 * MiB
    # Less than 1 MiB would remain, so the block is not split: the whole segment is allocated.
    assert pool.memory_allocated() == 12 * MiB
    assert pool.memory_stats()["requested_bytes.all.current"] == 11 * MiB + 1
    check_pool(pool, [ptr])


def test_small_requests_share_a_2_mib_segment(pool):
    ptrs = [pool.alloc(size) for size in (1, 1000, 4 * KiB, 100 * KiB, MiB)]
    [segment] = segments_of(pool)
    assert segment["total_size"] == 2 * MiB and segment["segment_type"] == "small"
    assert pool.memory_stats()["segment.small_pool.current"] == 1
    check_pool(pool, ptrs)


def test_freed_neighbours_coalesce(pool):
    first, second, third, fourth = (pool.alloc(512) for _ in range(4))
    second.free()
    third.free()
    [segment] = segments_of(pool)
    blocks = sorted(segment["blocks"], key=lambda b: b["address"])
    assert [(b["address"], b["size"], b["state"]) for b in blocks[:3]] == [
        (first.ptr, 512, "active_allocated"),
        (second.ptr, 1024, "inactive"),
        (fourth.ptr, 512, "active_allocated"),
    ]
    check_pool(pool, [first, fourth])


def test_reset_peak_memory_stats(pool):
    pool.alloc(4 * MiB).free()
    assert pool.max_memory_allocated() == 4 * MiB
    assert pool.max_memory_reserved() == 20 * MiB
    pool.reset_peak_memory_stats()
    assert pool.max_memory_allocated() == pool.memory_allocated() == 0
    assert pool.max_memory_reserved() == pool.memory_reserved() == 20 * MiB
    stats = pool.memory_stats()
    assert all(stats[f"{name}.all.peak"] == stats[f"{name}.all.current"] for name in STAT_NAMES)


def test_empty_cache_releases_only_fully_free_segments(pool):
    kept_small = pool.alloc(1000)
    kept_large = pool.alloc(3 * MiB // 2)
    pool.alloc(3 * MiB // 2).free()  # a free block in kept_large's partly used 20 MiB segment
    pool.alloc(24 * MiB).free()  # too big for that segment's rest: a segment of its own
    assert pool.memory_reserved() == 2 * MiB + 20 * MiB + 24 * MiB
    pool.empty_cache()
    assert pool.memory_reserved() == pool.device_memory_held() == 2 * MiB + 20 * MiB
    assert pool.memory_stats()["num_device_free"] == 1
    check_pool(pool, [kept_small, kept_large])


def test_refusal_releases_the_cache_and_retries():
    pool = gpupool.Pool("sim", capacity=64 * MiB, config="strategy:pytorch")
    pool.alloc(40 * MiB).free()
    ptr = pool.alloc(50 * MiB)
    stats = pool.memory_stats()
    assert (stats["num_alloc_retries"], stats["num_ooms"]) == (1, 0)
    assert pool.memory_reserved() == 50 * MiB
    assert stats["num_device_free"] == 1
    with pytest.raises(gpupool.OutOfMemoryError):
        pool.alloc(20 * MiB)
    stats = pool.memory_stats()
    assert (stats["num_alloc_retries"], stats["num_ooms"]) == (2, 1)
    check_pool(pool, [ptr])


def test_device_allocates_without_pooling():
    device = gpupool.Device("sim", capacity=4 * MiB)
    address = device.allocate(3 * MiB)
    with pytest.raises(gpupool.OutOfMemoryError):
        device.allocate(2 * MiB)
    device.release(address)
    device.release(device.allocate(4 * MiB))
    host = gpupool.Device()
    host.release(host.allocate(1000))


def test_zero_byte_device_allocations_give_back_what_they_held():
    # A zero-byte request holds a byte of host memory; giving it back must not wrap the count.
    host = gpupool.Device("host", capacity=4096)
    for _ in range(3):
        host.release(host.allocate(0))
    host.release(host.allocate(4096))


def test_max_split_size_keeps_oversize_blocks_whole():
    pool = gpupool.Pool("sim", capacity="1GiB", config="strategy:pytorch,max_split_size_mb:32")
    assert pool.config["max_split_size_mb"] == 32
    pool.alloc(40 * MiB).free()
    below = pool.alloc(20 * MiB)  # under max_split_size: may not carve up the cached 40 MiB block
    assert pool.memory_reserved() == 60 * MiB
    above = pool.alloc(36 * MiB)  # over it, and within max_non_split_rounding (20 MiB): takes it whole
    assert pool.memory_reserved() == 60 * MiB
    assert pool.memory_allocated() == 60 * MiB
    check_pool(pool, [below, above])
