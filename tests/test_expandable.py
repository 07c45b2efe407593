"""Paged strategies (`expandable`, `pages`, `default`): pages are really mapped and really given back."""

from __future__ import annotations

import os

import pytest

import gpupool
from pool_checks import MiB

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


def touch(ptr) -> None:
    """Writes every page, so the OS has to back it."""
    ptr.copy_from_host(b"\x01" * ptr.size)


@pytest.mark.parametrize("strategy", ["expandable", "pages", "default"])
def test_resident_memory_falls_once_frees_cross_the_watermark(strategy):
    pool = gpupool.Pool("host", config=f"strategy:{strategy},release_threshold:0.5")
    ptrs = [pool.alloc(16 * MiB) for _ in range(8)]
    for p in ptrs:
        touch(p)
    before = resident_bytes()
    # 3 of 8 freed: below the watermark, the pages stay mapped for reuse.
    for p in ptrs[:3]:
        p.free()
    assert resident_bytes() > before - 16 * MiB
    assert pool.memory_stats()["num_device_unmap"] == 0
    # By the 5th free, free memory crosses half of reserved: free pages go back to the OS.
    for p in ptrs[3:5]:
        p.free()
    assert pool.memory_stats()["num_device_unmap"] >= 1
    # 64 MiB of pages went back; the interpreter's own heap may have grown meanwhile (by just
    # over 4 MiB in one run of the whole suite), so three quarters of it must show.
    assert resident_bytes() <= before - 48 * MiB
    assert pool.memory_reserved() <= 3 * 16 * MiB + 2 * 20 * MiB
    pool.check_invariants()


def test_without_a_watermark_pages_stay_mapped_until_empty_cache():
    pool = gpupool.Pool("host", config="strategy:default")
    ptr = pool.alloc(64 * MiB)
    touch(ptr)
    reserved = pool.memory_reserved()
    ptr.free()
    assert pool.memory_reserved() == reserved, "mapped pages are kept for reuse"
    before = resident_bytes()
    pool.empty_cache()
    assert pool.memory_reserved() == 0 and pool.device_memory_held() == 0
    assert resident_bytes() < before - 48 * MiB


def test_a_hole_costs_no_memory_once_unmapped():
    # Free every other 8 MiB block: 32 MiB of holes that no 24 MiB request fits into. Plain
    # segments would need 24 MiB more; pages move to where they are needed instead.
    pool = gpupool.Pool("sim", capacity="72MiB", config="strategy:default")
    ptrs = [pool.alloc(8 * MiB) for _ in range(8)]
    for p in ptrs[::2]:
        p.free()
    big = pool.alloc(24 * MiB)
    stats = pool.memory_stats()
    # The refused map gave the holes' pages back (no stream has queued work) and mapped again,
    # without the out-of-memory path's wait and retry.
    assert (stats["num_alloc_retries"], stats["num_ooms"]) == (0, 0)
    assert stats["num_device_unmap"] >= 1
    assert pool.memory_reserved() <= 72 * MiB
    pool.check_invariants()
    big.free()


def test_snapshot_marks_paged_segments_and_the_default_is_paged():
    pool = gpupool.Pool("sim", capacity="1GiB")
    assert pool.config["strategy"] == "default"
    pool.alloc(2 * MiB)
    [segment] = pool.snapshot()["segments"]
    assert segment["is_expandable"] is True
    assert pool.memory_reserved() == 20 * MiB, "one map call reaches 20 MiB ahead"


@pytest.mark.parametrize("strategy", ["default", "expandable", "pages"])
def test_max_split_size_keeps_requests_in_their_ranges(strategy):
    # PyTorch's cap keeps small requests off oversize blocks; a range's free space is one such
    # block, and passing over it used to reserve a new range (of twice the device) per request:
    # 50 reservations for 50 tiny allocations, and out of memory with 56% of the device in use.
    pool = gpupool.Pool("sim", capacity="1GiB", config=f"strategy:{strategy},max_split_size_mb:20")
    live = [pool.alloc(100) for _ in range(50)]
    live += [pool.alloc(30 * MiB) for _ in range(10)]
    live += [pool.alloc(3 * MiB) for _ in range(50)]
    stats = pool.memory_stats()
    assert stats["num_driver_reserve"] == 2, "one range for each pool kind"
    assert pool.memory_reserved() <= 1.05 * pool.memory_allocated() + 20 * MiB
    for ptr in live:
        ptr.free()
    pool.check_invariants()


@pytest.mark.parametrize("strategy", ["default", "expandable", "pages"])
def test_max_split_size_keeps_cached_blocks_of_a_range_whole(strategy):
    # Growing into a range's free space passes the cap, but a block freed on mapped pages is
    # cached memory, not address space: a small request carved it up, and the next big one
    # mapped new pages instead of reusing it. PyTorch maps the small one from the unmapped rest.
    pool = gpupool.Pool("sim", capacity="1GiB", config=f"strategy:{strategy},max_split_size_mb:20")
    big = pool.alloc(64 * MiB)
    keep = pool.alloc(4 * MiB)
    cached = big.ptr
    big.free()
    small = pool.alloc(4 * MiB)
    assert not cached <= small.ptr < cached + 64 * MiB, "a small request split a cached oversize block"
    again = pool.alloc(64 * MiB)
    assert again.ptr == cached
    for ptr in (keep, small, again):
        ptr.free()
    pool.check_invariants()
