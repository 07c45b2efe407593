"""Runs of same-size allocations (`rust/pool/size_run.rs`): gpupool's pager sends the blocks of a
long run, when at most a page, to its small range."""

from __future__ import annotations

import bench_scripts
import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import gpupool
from gpupool.trace import load, replay
from pool_checks import EXAMPLES_SCALE, MiB, check_pool


def segment_type_of(pool, ptr) -> str:
    [kind] = [
        s["segment_type"]
        for s in pool.snapshot()["segments"]
        if s["address"] <= ptr.ptr < s["address"] + s["total_size"]
    ]
    return kind


@pytest.mark.parametrize("config", ["strategy:default", "strategy:default,max_split_size_mb:20"])
def test_a_long_run_of_same_size_blocks_goes_to_the_small_range_when_the_device_is_nearly_full(config):
    # A run of same-size tensors (a request's K and V per layer) lives and dies together: past
    # the first eight, blocks of at most a page leave the large range's pieces alone, once less
    # than a tenth of the device is left.
    pool = gpupool.Pool("sim", capacity="256MiB", config=config)
    hold = pool.alloc(232 * MiB)
    run = [pool.alloc(512 << 10) for _ in range(12)]
    assert [segment_type_of(pool, p) for p in run] == ["large"] * 8 + ["small"] * 4
    mixed = [pool.alloc(size) for _ in range(6) for size in (768 << 10, 512 << 10)]
    assert {segment_type_of(pool, p) for p in mixed} == {"large"}, "sizes that alternate make no run"
    check_pool(pool, [hold, *run, *mixed])
    for ptr in run + mixed:
        ptr.free()
    big = [pool.alloc(9 << 18) for _ in range(9)]  # 2.25 MiB: more than a page
    assert {segment_type_of(pool, p) for p in big} == {"large"}, "a block over a page is no small block"
    assert pool.memory_stats()["num_driver_reserve"] == 2, "one range for each pool kind"
    check_pool(pool, [hold, *big])
    for ptr in [hold, *big]:
        ptr.free()
    check_pool(pool, [])


def test_with_room_to_spare_a_run_stays_in_the_large_range():
    pool = gpupool.Pool("sim", capacity="4GiB")
    run = [pool.alloc(512 << 10) for _ in range(12)]
    assert {segment_type_of(pool, p) for p in run} == {"large"}
    assert pool.memory_stats()["num_driver_reserve"] == 1


def test_the_reference_pager_keeps_its_own_small_pool():
    pool = gpupool.Pool("sim", capacity="4GiB", config="strategy:pages")
    run = [pool.alloc(1536 << 10) for _ in range(12)]
    assert {segment_type_of(pool, p) for p in run} == {"large"}


def test_serving_with_a_kv_tensor_per_request_needs_no_more_than_pytorchs_expandable_segments(tmp_path):
    # benches/serving_kv.py: requests' KV tensors outlive their neighbours. Before long runs went
    # to the small range, the default needed 10 MiB more than `expandable` on program 7.
    serving_kv = bench_scripts.load("serving_kv")
    for seed in range(10):
        path = str(tmp_path / f"serving_kv_{seed}.csv.gz")
        serving_kv.serving_trace(seed, path)
        trace = load(path)
        default, expandable = (
            replay(trace, f"strategy:{s}", min_capacity=True).min_capacity_bytes for s in ("default", "expandable")
        )
        assert default <= expandable, f"program {seed}: {default / MiB:,.0f} MiB > {expandable / MiB:,.0f} MiB"


RUN_SIZES = [64 << 10, 300 << 10, 512 << 10, MiB, 2 * MiB, 3 * MiB]


@settings(max_examples=40 * EXAMPLES_SCALE, deadline=None)
@given(
    runs=st.lists(st.tuples(st.sampled_from(RUN_SIZES), st.integers(1, 20), st.floats(0, 1)), min_size=1, max_size=10),
    order=st.randoms(use_true_random=False),
)
def test_runs_of_one_size_keep_blocks_apart_and_intact(runs, order):
    # Runs of every length, each followed by frees of a random share of what is live: blocks
    # land in either range, and every check of the pool, its snapshot and its statistics holds,
    # with each block's bytes intact.
    # A device a held block nearly fills: runs go to the small range past their eighth block.
    pool = gpupool.Pool("host", capacity="320MiB", config="strategy:default")
    hold = pool.alloc(256 * MiB)
    live = []
    for size, length, share in runs:
        for _ in range(length):
            try:
                ptr = pool.alloc(size)
            except gpupool.OutOfMemoryError:
                continue
            ptr.copy_from_host(len(live).to_bytes(8, "little") * 2)
            live.append((ptr, len(live)))
        order.shuffle(live)
        for ptr, _ in live[: int(share * len(live))]:
            ptr.free()
        live = live[int(share * len(live)) :]
        check_pool(pool, [hold, *(ptr for ptr, _ in live)])
    for ptr, mark in live:
        assert ptr.copy_to_host(size=16) == mark.to_bytes(8, "little") * 2
        ptr.free()
    hold.free()
    check_pool(pool, [])
