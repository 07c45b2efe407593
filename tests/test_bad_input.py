"""Misuse of the Python API: clear exceptions, and the pool stays intact afterwards."""

from __future__ import annotations

import gc
import re

import numpy as np
import pytest

import gpupool
from pool_checks import MiB, check_pool

OOM_MESSAGE_WORDS = (
    "capacity",
    "free",
    "allocated",
    "reserved",
    "largest free block",
    "fragmentation",
)


@pytest.fixture
def pool():
    return gpupool.Pool("host")


def test_negative_size_is_a_value_error(pool):
    with pytest.raises(ValueError):
        pool.alloc(-1)
    check_pool(pool, [])


# A bool is an int to Python, but as a size it is a mistake: PyTorch and NumPy refuse it too.
@pytest.mark.parametrize("size", [1.5, "x", None, b"12", True, np.float64(8.0), np.array([8, 8])])
def test_non_integer_size_is_a_type_error(pool, size):
    with pytest.raises(TypeError):
        pool.alloc(size)
    check_pool(pool, [])


def test_numpy_integers_are_sizes_with_the_same_checks(pool):
    # Sizes computed with NumPy (np.prod(shape) * itemsize) are NumPy integers.
    ptr = pool.alloc(np.int64(1000))
    assert ptr.size == 1000
    ptr.copy_from_host(b"abcd", np.uint16(2))
    assert ptr.copy_to_host(np.int32(2), np.uint8(4)) == b"abcd"
    with pytest.raises(ValueError, match="non-negative"):
        pool.alloc(np.int64(-1))
    with pytest.raises(ValueError, match="absurdly large"):
        pool.alloc(np.uint64(2**63))
    with pytest.raises(TypeError, match="offset must be an int, not bool"):
        ptr.copy_to_host(True)
    assert gpupool.Pool("sim", capacity=np.int64(1 << 30)).capacity == 1 << 30
    check_pool(pool, [ptr])


@pytest.mark.parametrize("size", [2**62 + 1, 2**64, 2**70])
def test_absurd_size_is_a_value_error(pool, size):
    with pytest.raises(ValueError):
        pool.alloc(size)
    check_pool(pool, [])


def test_zero_size_uses_no_memory(pool):
    before = pool.memory_stats()
    ptr = pool.alloc(0)
    assert ptr.size == 0 and not ptr.freed
    assert pool.memory_stats() == before
    ptr.free()
    assert ptr.freed
    assert pool.memory_stats() == before


def test_double_free_is_detected_and_harmless(pool):
    ptr = pool.alloc(1000)
    other = pool.alloc(1000)
    ptr.free()
    with pytest.raises(ValueError, match="double free"):
        ptr.free()
    with pytest.raises(ValueError, match="double free"):
        pool.free(ptr)
    check_pool(pool, [other])
    assert pool.alloc(1000).size == 1000


def test_freeing_another_pools_pointer_is_refused(pool):
    other_pool = gpupool.Pool("host")
    ptr = other_pool.alloc(4096)
    with pytest.raises(ValueError):
        pool.free(ptr)
    assert not ptr.freed
    check_pool(pool, [])
    check_pool(other_pool, [ptr])


def test_freed_memory_cannot_be_read(pool):
    ptr = pool.alloc(4096)
    ptr.free()
    with pytest.raises(ValueError):
        ptr.copy_to_host()
    with pytest.raises(ValueError):
        ptr.copy_from_host(b"abc")
    with pytest.raises(ValueError):
        np.asarray(ptr)


def test_copies_from_a_device_without_bytes_are_refused_before_any_buffer():
    sim = gpupool.Pool("sim", capacity=1 << 50)
    huge = sim.alloc(1 << 48)  # no host could hold a bytes object this large
    with pytest.raises(ValueError, match="device 'sim' does not support copies"):
        huge.copy_to_host()
    assert huge.copy_to_host(size=0) == b""
    check_pool(sim, [huge])


@pytest.mark.parametrize(("length", "offset"), [(4097, 0), (1, 4096), (4096, 1), (1, -1)])
def test_writes_past_the_allocation_are_refused(pool, length, offset):
    ptr = pool.alloc(4096)
    ptr.copy_from_host(b"\x07" * 4096)
    with pytest.raises(ValueError):
        ptr.copy_from_host(b"\x01" * length, offset)
    assert ptr.copy_to_host() == b"\x07" * 4096


def test_unknown_device_is_named():
    with pytest.raises(ValueError, match="tpu"):
        gpupool.Pool("tpu")
    with pytest.raises(ValueError, match="tpu"):
        gpupool.Device("tpu")


def test_sim_needs_a_capacity():
    with pytest.raises(ValueError, match="capacity"):
        gpupool.Pool("sim")


@pytest.mark.parametrize("capacity", ["12 parsecs", "", "-1GiB", "GiB", -1, "1.5", "4096.5B"])
def test_bad_capacity_is_named(capacity):
    with pytest.raises(ValueError, match="capacity"):
        gpupool.Pool("sim", capacity=capacity)


@pytest.mark.parametrize("device", ["sim", "host"])
@pytest.mark.parametrize("strategy", ["default", "pages", "expandable"])
def test_a_page_larger_than_the_device_is_named(device, strategy):
    config = f"strategy:{strategy},page_size_mb:64"
    message = rf"page_size_mb: strategy {strategy} maps pages of 64\.00 MiB, more than .*32\.00 MiB"
    with pytest.raises(ValueError, match=message):
        gpupool.Pool(device, capacity="32MiB", config=config)
    # A page the device can hold is accepted, and used.
    with gpupool.Pool(device, capacity="64MiB", config=config).alloc(1 << 20) as ptr:
        assert ptr.size == 1 << 20


@pytest.mark.parametrize("strategy", ["pytorch", "eager"])
def test_a_large_segment_larger_than_the_device_is_named(strategy):
    config = f"strategy:{strategy},large_segment_size_mb:64"
    message = rf"large_segment_size_mb: strategy {strategy} takes segments of 64\.00 MiB, more than sim's 32\.00 MiB"
    with pytest.raises(ValueError, match=message):
        gpupool.Pool("sim", capacity="32MiB", config=config)
    # One the device can hold is accepted, and serves requests between 1 and 10 MiB.
    pool = gpupool.Pool("sim", capacity="64MiB", config=config)
    with pool.alloc(2 << 20):
        assert pool.memory_reserved() == 64 << 20
    # Strategies that never take such a segment ignore the key, as before.
    with gpupool.Pool("sim", capacity="32MiB", config="strategy:bfc,large_segment_size_mb:64").alloc(2 << 20):
        pass


@pytest.mark.parametrize("strategy", ["default", "pages", "expandable"])
def test_a_large_segment_larger_than_the_device_is_ignored_by_paged_strategies(strategy):
    # They share PyTorch's rules but grow by pages: the key shapes nothing there, as before.
    pool = gpupool.Pool("sim", capacity="32MiB", config=f"strategy:{strategy},large_segment_size_mb:64")
    with pool.alloc(2 << 20):
        assert pool.memory_reserved() < 32 << 20


def test_unknown_config_key_is_named():
    with pytest.raises(ValueError, match="no_such_knob"):
        gpupool.Pool("host", config="no_such_knob:1")


def test_pointer_keeps_its_pool_alive():
    pool = gpupool.Pool("host")
    ptr = pool.alloc(1000)
    ptr.copy_from_host(b"\x2a" * 1000)
    del pool
    gc.collect()
    assert ptr.copy_to_host() == b"\x2a" * 1000
    ptr.free()
    assert ptr.freed


def test_context_manager_frees(pool):
    with pool.alloc(4096) as ptr:
        check_pool(pool, [ptr])
    assert ptr.freed
    check_pool(pool, [])


def test_context_manager_tolerates_an_explicit_free(pool):
    with pool.alloc(4096) as ptr:
        ptr.free()
    check_pool(pool, [])


def test_dropping_the_last_reference_frees(pool):
    pool.alloc(4096)
    gc.collect()
    check_pool(pool, [])
    assert pool.memory_stats()["allocation.all.freed"] == 1


def test_out_of_memory_message_explains_the_state():
    pool = gpupool.Pool("sim", capacity=64 * MiB)
    held = pool.alloc(30 * MiB)
    with pytest.raises(gpupool.OutOfMemoryError) as caught:
        pool.alloc(100 * MiB)
    assert isinstance(caught.value, MemoryError)
    message = str(caught.value).lower()
    assert re.search(r"104857600|100(\.0+)? ?mib", message), message
    for words in OOM_MESSAGE_WORDS:
        assert words in message, f"{words!r} missing from: {message}"
    check_pool(pool, [held])
