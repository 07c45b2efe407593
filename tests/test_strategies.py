"""The configuration string and the strategies it selects: PyTorch's documented behaviour for
`pytorch`, each preset's own, the release watermark, and bad settings."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import gpupool
from pool_checks import STRATEGIES, MiB, check_pool


def sim(config: str, capacity: str = "64GiB") -> gpupool.Pool:
    return gpupool.Pool("sim", capacity=capacity, config=config)


def segment_sizes(pool) -> list[int]:
    return sorted(s["total_size"] for s in pool.snapshot()["segments"])


@pytest.mark.parametrize(
    ("first", "second", "reserved"), [((16, 8), (32, 4), 256 * MiB), ((32, 4), (16, 8), 128 * MiB)]
)
def test_pytorch_allocation_order_changes_reservation(first, second, reserved):
    pool = sim("strategy:pytorch")
    for size, count in (first, second):
        for ptr in [pool.alloc(size * MiB) for _ in range(count)]:
            ptr.free()
    assert pool.memory_reserved() == reserved


def test_pytorch_segment_sizes():
    pool = sim("strategy:pytorch")
    pool.alloc(3 * MiB // 2)
    assert segment_sizes(pool) == [20 * MiB]
    pool = sim("strategy:pytorch")
    ptr = pool.alloc(11 * MiB + 1)
    (segment,) = pool.snapshot()["segments"]
    assert segment["total_size"] == 12 * MiB
    # Rounded to 11 MiB + 512 B, but less than 1 MiB would remain: the block is the segment.
    assert segment["blocks"][0]["size"] == 12 * MiB
    assert pool.memory_stats()["requested_bytes.all.current"] == ptr.size == 11 * MiB + 1


def test_pytorch_max_split_size_keeps_big_blocks_whole():
    pool = sim("strategy:pytorch,max_split_size_mb:20")
    pool.alloc(64 * MiB).free()
    pool.alloc(4 * MiB)
    assert segment_sizes(pool) == [20 * MiB, 64 * MiB]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_serves_reuses_and_returns_memory(strategy):
    pool = sim(f"strategy:{strategy}", capacity="4GiB")
    assert pool.config["strategy"] == strategy
    live = [pool.alloc(size) for size in (1, 4096, 3 * MiB, 40 * MiB)]
    check_pool(pool, live)
    live.pop().free()
    live.append(pool.alloc(40 * MiB))
    check_pool(pool, live)
    for ptr in live:
        ptr.free()
    pool.empty_cache()
    assert pool.memory_reserved() == 0


def test_strategies_differ_where_their_frameworks_do():
    assert segment_sizes(sim("strategy:direct")) == []
    bfc = sim("strategy:bfc")
    bfc.alloc(1000)
    bfc.alloc(3 * MiB)
    assert segment_sizes(bfc) == [2 * MiB, 4 * MiB]
    arena = sim("strategy:arena,initial_pool_size_mb:64")
    assert segment_sizes(arena) == [64 * MiB]
    arena.alloc(100 * MiB)
    assert segment_sizes(arena) == [64 * MiB, 128 * MiB]
    direct = sim("strategy:direct")
    ptr = direct.alloc(1000)
    assert segment_sizes(direct) == [1024]
    ptr.free()
    assert direct.memory_reserved() == 0


# The paged strategies' pre-allocation unit: a page, or PyTorch's 20 MiB handle.
PAGED_UNIT = {"default": 2 * MiB, "pages": 2 * MiB, "expandable": 20 * MiB}


@given(
    strategy=st.sampled_from(sorted(PAGED_UNIT)),
    initial_mb=st.integers(0, 300),
    capacity_mb=st.integers(16, 512),
    fraction=st.sampled_from([None, 0.5]),
    sizes_mb=st.lists(st.integers(3, 40), max_size=8),
)
def test_paged_strategies_map_the_initial_pool_when_made(strategy, initial_mb, capacity_mb, fraction, sizes_mb):
    """`initial_pool_size_mb` under a paged strategy: that much memory, capped by the device and
    the memory fraction, in whole units, mapped before any request, then served with no device
    call, and given back by `empty_cache`."""
    config = f"strategy:{strategy},initial_pool_size_mb:{initial_mb}"
    if fraction is not None:
        config += f",per_process_memory_fraction:{fraction}"
    pool = sim(config, capacity=f"{capacity_mb}MiB")
    allowed = capacity_mb * MiB if fraction is None else int(capacity_mb * MiB * fraction)
    unit = PAGED_UNIT[strategy]
    initial = min(initial_mb * MiB, allowed) // unit * unit
    assert pool.memory_reserved() == initial
    assert pool.memory_stats()["num_device_map"] == (initial > 0)
    assert pool.config["initial_pool_size_mb"] == initial_mb
    # Requests that fit in the mapped front, above the small pools' sizes, map nothing more.
    live, used = [], 0
    for size in (mb * MiB for mb in sizes_mb):
        if used + size > initial:
            break
        live.append(pool.alloc(size))
        used += size
    stats = pool.memory_stats()
    assert (pool.memory_reserved(), stats["num_device_map"]) == (initial, initial > 0)
    assert stats["allocated_bytes.all.current"] == used
    check_pool(pool, live)
    for ptr in live:
        ptr.free()
    pool.empty_cache()
    assert pool.memory_reserved() == 0


def test_the_release_watermark_gives_idle_segments_back():
    pool = sim("strategy:pytorch,release_threshold:0.5")
    a, b, c = (pool.alloc(12 * MiB) for _ in range(3))
    a.free()
    assert pool.memory_reserved() == 36 * MiB
    b.free()
    # 24 of 36 MiB free is over half: one idle segment goes, leaving 12 of 24.
    assert pool.memory_reserved() == 24 * MiB
    c.free()
    assert pool.memory_reserved() == 0


def test_the_memory_fraction_caps_the_pool():
    pool = sim("per_process_memory_fraction:0.25", capacity="400MiB")
    held = pool.alloc(60 * MiB)
    with pytest.raises(gpupool.OutOfMemoryError, match="per_process_memory_fraction"):
        pool.alloc(60 * MiB)
    assert pool.memory_reserved() == held.size


def test_config_lists_every_effective_setting():
    pool = sim("strategy:pytorch,roundup_power2_divisions:[256:1,512:2,>:8],max_split_size_mb:64")
    config = pool.config
    assert config == pool.snapshot()["allocator_settings"]
    assert config["strategy"] == "pytorch" and config["backend"] == "native"
    assert config["max_split_size_mb"] == 64
    assert config["max_non_split_rounding_mb"] == 20
    assert config["roundup_power2_divisions"]["256"] == 1
    assert config["roundup_power2_divisions"]["512"] == 2
    assert config["roundup_power2_divisions"]["1024"] == 8
    assert config["garbage_collection_threshold"] is None
    assert config["expandable_segments"] is False
    assert config["per_process_memory_fraction"] is None
    assert config["release_threshold"] is None
    assert config["cross_stream_reuse"] == "completed"
    assert sim("strategy:direct").config["release_threshold"] == 0.0


PYTORCH_CONF = (
    "backend:native,max_split_size_mb:128,max_non_split_rounding_mb:64,"
    "roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.6,"
    "expandable_segments:False,release_lock_on_cudamalloc:True,per_process_memory_fraction:0.9,"
    "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
)


def test_a_pytorch_config_pastes_as_is():
    config = sim(PYTORCH_CONF).config
    assert config["max_split_size_mb"] == 128
    assert config["garbage_collection_threshold"] == 0.6
    assert config["per_process_memory_fraction"] == 0.9
    assert config["release_lock_on_cudamalloc"] is True


def test_the_environment_variable_applies_when_config_is_none(monkeypatch):
    monkeypatch.setenv("GPUPOOL_ALLOC_CONF", "strategy:bfc,release_threshold:0.5")
    pool = gpupool.Pool("sim", capacity="1GiB")
    assert pool.config["strategy"] == "bfc" and pool.config["release_threshold"] == 0.5
    assert sim("strategy:eager").config["strategy"] == "eager", "an explicit config wins"
    monkeypatch.setenv("GPUPOOL_ALLOC_CONF", "bogus:1")
    with pytest.raises(ValueError, match="GPUPOOL_ALLOC_CONF.*bogus"):
        gpupool.Pool("sim", capacity="1GiB")


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ("bogus:1", "bogus"),
        ("strategy:tlsf", "strategy"),
        ("backend:cuda", "backend"),
        ("max_split_size_mb:4", "max_split_size_mb"),
        ("max_non_split_rounding_mb:x", "max_non_split_rounding_mb"),
        ("roundup_power2_divisions:[100:2]", "roundup_power2_divisions"),
        ("garbage_collection_threshold:1.5", "garbage_collection_threshold"),
        ("expandable_segments:yes", "expandable_segments"),
        ("release_lock_on_cudamalloc:1", "release_lock_on_cudamalloc"),
        ("per_process_memory_fraction:2", "per_process_memory_fraction"),
        ("large_segment_size_mb:0", "large_segment_size_mb"),
        ("release_threshold:1.5", "release_threshold"),
        ("initial_pool_size_mb:-3", "initial_pool_size_mb"),
        ("page_size_mb:0", "page_size_mb"),
        ("page_size_mb:3", "page_size_mb"),
        ("cross_stream_reuse:sometimes", "cross_stream_reuse"),
        ("strategy:bfc,expandable_segments:True", "expandable_segments"),
        ("max_split_size_mb", "max_split_size_mb"),
        # The arena's first block and BFC's doubling regions pass any limit; over it they would
        # serve no smaller request (a second 100 B allocation failed on a 1 GiB device).
        ("strategy:arena,max_split_size_mb:20", "max_split_size_mb"),
        ("strategy:bfc,max_split_size_mb:64", "max_split_size_mb"),
        # Keys of the paged strategies' pages, with a strategy of plain segments.
        ("strategy:pytorch,page_size_mb:4", "'page_size_mb' applies to the paged strategies"),
        ("strategy:bfc,shareable_handle:posix_fd", "'shareable_handle' applies to the paged"),
        ("backend:cudaMallocAsync,peer_access:[1]", "'peer_access' applies to .* not to strategy 'direct'"),
        ("expandable_segments:False,page_size_mb:2", "'page_size_mb'"),
    ],
)
def test_bad_settings_raise_value_error_naming_the_key(config, key):
    with pytest.raises(ValueError, match=key):
        sim(config)


def test_paged_keys_at_their_defaults_combine_with_any_strategy():
    for strategy in STRATEGIES:
        assert sim(f"strategy:{strategy},shareable_handle:none").config["shareable_handle"] == "none"


@pytest.mark.parametrize("complete", ["stream.synchronize", "stream.destroy", "pool.synchronize"])
@pytest.mark.parametrize("config", ["strategy:direct", "strategy:pytorch,release_threshold:0"])
def test_the_release_watermark_covers_frees_that_complete_later(complete, config):
    # A free waiting for another stream's work completes outside `free`: the watermark applies
    # then too, or `direct` would keep the block reserved until some later free.
    pool = sim(config)
    stream = pool.stream()
    ptr = pool.alloc(3 * MiB)
    stream.hold()
    ptr.record_stream(stream)
    ptr.free()
    assert pool.memory_reserved() > 0
    target, method = complete.split(".")
    getattr(stream if target == "stream" else pool, method)()
    assert pool.memory_reserved() == 0
