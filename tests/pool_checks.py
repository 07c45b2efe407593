"""Shared by the pool tests: each strategy's size rules, data patterns, a whole-pool check."""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from dataclasses import dataclass

KiB = 1 << 10
MiB = 1 << 20

# Suites that fix their own example counts multiply them by this, so that the Hypothesis profile
# (conftest.py: "ci", "thorough", "fuzz") scales every suite, not only those without settings.
EXAMPLES_SCALE = {"ci": 1, "thorough": 5, "fuzz": 10}[os.environ.get("HYPOTHESIS_PROFILE", "ci")]

# Every strategy the contract suites run against (add "default" once it parses).
STRATEGIES = ("default", "pytorch", "bfc", "arena", "eager", "direct", "expandable", "pages")


@dataclass(frozen=True)
class SizeRules:
    """What a strategy promises about sizes (rust/core/rules.rs)."""

    granule: int
    small_pool: bool
    # PyTorch's fixed 2 MiB / 20 MiB / rounded segment sizes; else a new segment is at most
    # what the device has left, and at least the request.
    fixed_segments: bool
    # Expandable strategies map pages of this size instead of allocating segments.
    page_size: int = 0
    # Rounded requests up to this size are small.
    small_max: int = MiB


RULES = {
    "pytorch": SizeRules(512, small_pool=True, fixed_segments=True),
    "bfc": SizeRules(256, small_pool=False, fixed_segments=False),
    "arena": SizeRules(512, small_pool=False, fixed_segments=False),
    "eager": SizeRules(512, small_pool=False, fixed_segments=True),
    "direct": SizeRules(512, small_pool=False, fixed_segments=False),
    # PyTorch's handles: 20 MiB in the large pool (pool.config's page_size_mb), 2 MiB small.
    "expandable": SizeRules(512, small_pool=True, fixed_segments=False, page_size=20 * MiB),
    "pages": SizeRules(512, small_pool=True, fixed_segments=False, page_size=2 * MiB),
    "default": SizeRules(512, small_pool=True, fixed_segments=False, page_size=2 * MiB),
}


def rules_of(pool) -> SizeRules:
    config = pool.config
    rules = RULES[config["strategy"]]
    if rules.page_size:
        page_size = config["page_size_mb"] * MiB
        return SizeRules(rules.granule, rules.small_pool, False, page_size)
    return rules


# The keys PyTorch's snapshot viewer reads from each segment and block.
SEGMENT_KEYS = {
    "device",
    "address",
    "total_size",
    "allocated_size",
    "active_size",
    "requested_size",
    "stream",
    "segment_type",
    "segment_pool_id",
    "is_expandable",
    "frames",
    "blocks",
}
BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}

STAT_NAMES = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
POOL_KINDS = ("all", "large_pool", "small_pool")
FIELDS = ("current", "peak", "allocated", "freed")


def rounded(size: int, granule: int = 512) -> int:
    """The block size a request needs: a multiple of the granule (PyTorch's 512 B), at least one."""
    return max(granule, -(-size // granule) * granule)


def is_small(size: int, small_max: int = MiB) -> bool:
    return rounded(size) <= small_max


def growth_bound(rules: SizeRules, size: int) -> int:
    """The most new device memory serving ``size`` needs when no cached block fits it: a
    pool that refuses ``size`` after flushing its cache must have less than this left."""
    if rules.page_size:
        # The pages under the block, of which the two at its ends may already be mapped.
        return rounded(size, rules.granule) + 2 * rules.page_size
    if rules.fixed_segments:
        return segment_size(size)
    return rounded(size, rules.granule)


def segment_size(size: int) -> int:
    """The segment PyTorch obtains from the device for a request no cached block can serve."""
    block = rounded(size)
    if block <= MiB:
        return 2 * MiB
    if block < 10 * MiB:
        return 20 * MiB
    return -(-block // (2 * MiB)) * 2 * MiB


def _pattern(size: int, tag: int, span: int) -> list[tuple[int, bytes]]:
    """Bytes unique to ``tag`` covering the whole allocation, or its first and last ``span``."""
    rng = random.Random(tag)
    if size <= 2 * span:
        return [(0, rng.randbytes(size))]
    return [(0, rng.randbytes(span)), (size - span, rng.randbytes(span))]


def stamp(ptr, tag: int, span: int = 4 * KiB) -> None:
    for offset, data in _pattern(ptr.size, tag, span):
        ptr.copy_from_host(data, offset)


def verify(ptr, tag: int, span: int = 4 * KiB) -> None:
    contents = ptr.copy_to_host()
    assert len(contents) == ptr.size
    for offset, data in _pattern(ptr.size, tag, span):
        assert contents[offset : offset + len(data)] == data, f"allocation {tag} overwritten near {offset}"


@dataclass
class Ledger:
    """What a test did to a pool, counted on the test's side: the counters' ``allocated`` and
    ``freed`` fields must equal it (PyTorch counts every increase and decrease)."""

    allocations: int = 0
    frees: int = 0
    requested_in: int = 0
    requested_out: int = 0

    def allocated(self, size: int) -> None:
        if size > 0:
            self.allocations += 1
            self.requested_in += size

    def freed(self, size: int) -> None:
        if size > 0:
            self.frees += 1
            self.requested_out += size


def check_pool(pool, live: Iterable, pending: int = 0, ledger: Ledger | None = None) -> None:
    """Asserts that the pool's own check, its snapshot and its statistics agree with ``live``
    (the allocations a test holds), ``pending`` (bytes of blocks freed but still active: waiting
    on other streams or held for exports) and, if given, the ``ledger`` of what the test did.
    As in PyTorch, a pending block's request counts in ``requested_bytes`` until its free
    completes."""
    pool.check_invariants()
    live = [ptr for ptr in live if ptr.size > 0]
    rules = rules_of(pool)
    segments = pool.snapshot()["segments"]
    _check_segments(rules, segments)
    _check_live(rules, segments, live)
    _check_stats(pool, rules, segments, live, pending)
    if ledger is not None:
        _check_ledger(pool.memory_stats(), ledger, _pending_requested(segments))


def _pending_requested(segments: list[dict]) -> int:
    return sum(b["requested_size"] for s in segments for b in s["blocks"] if b["state"] == "active_pending_free")


def check_watermark(pool) -> None:
    """After a free: over the release watermark only if no idle segment is left (expandable
    ranges give pages back instead)."""
    threshold = pool.config["release_threshold"]
    if threshold is None or rules_of(pool).page_size:
        return
    stats = pool.memory_stats()
    reserved = stats["reserved_bytes.all.current"]
    if reserved - stats["active_bytes.all.current"] > threshold * reserved:
        for segment in pool.snapshot()["segments"]:
            idle = len(segment["blocks"]) == 1 and segment["blocks"][0]["state"] == "inactive"
            assert not idle, "over the watermark with an idle segment"


def drain(pool, live: Iterable) -> None:
    """Frees every live allocation, empties the cache and asserts the device got everything back."""
    for ptr in live:
        ptr.free()
    check_pool(pool, [])
    pool.empty_cache()
    assert pool.memory_reserved() == 0
    assert pool.device_memory_held() == 0


def _check_segments(rules: SizeRules, segments: list[dict]) -> None:
    end_of_previous = 0
    for segment in sorted(segments, key=lambda s: s["address"]):
        assert segment["address"] >= end_of_previous, "segments overlap"
        end_of_previous = segment["address"] + segment["total_size"]
        assert segment["segment_type"] in (("large", "small") if rules.small_pool else ("large",))
        if segment["segment_type"] == "small" and not rules.page_size:
            assert segment["total_size"] == 2 * MiB
        blocks = sorted(segment["blocks"], key=lambda b: b["address"])
        address = segment["address"]
        for block in blocks:
            assert block["address"] == address, f"blocks do not tile segment {segment['address']:#x}"
            address += block["size"]
        assert address == end_of_previous, f"blocks do not tile segment {segment['address']:#x}"
        in_use = [b for b in blocks if b["state"] == "active_allocated"]
        assert segment["allocated_size"] == sum(b["size"] for b in in_use)
        active = [b for b in blocks if b["state"] != "inactive"]
        assert segment["requested_size"] == sum(b["requested_size"] for b in active)
        assert all(b["requested_size"] == 0 for b in blocks if b["state"] == "inactive")


def _check_live(rules: SizeRules, segments: list[dict], live: list) -> None:
    in_use = {
        block["address"]: (block, segment)
        for segment in segments
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    }
    assert len(in_use) == len(live), f"{len(in_use)} blocks in use, {len(live)} live allocations"
    for ptr in live:
        assert not ptr.freed
        assert ptr.ptr % rules.granule == 0, f"{ptr.ptr:#x} is not {rules.granule}-byte aligned"
        block, segment = in_use[ptr.ptr]
        assert block["requested_size"] == ptr.size
        assert block["size"] >= rounded(ptr.size, rules.granule)
        assert segment["address"] <= ptr.ptr
        end = ptr.ptr + rounded(ptr.size, rules.granule)
        assert end <= segment["address"] + segment["total_size"]
        small = rules.small_pool and is_small(ptr.size, rules.small_max)
        assert segment["segment_type"] == ("small" if small else "large")
    by_address = sorted(live, key=lambda p: p.ptr)
    for first, second in zip(by_address, by_address[1:], strict=False):
        end = first.ptr + rounded(first.size, rules.granule)
        assert end <= second.ptr, "live allocations overlap"


def _check_stats(pool, rules: SizeRules, segments: list[dict], live: list, pending: int) -> None:
    stats = pool.memory_stats()
    live_requested = sum(ptr.size for ptr in live)
    assert stats["requested_bytes.all.current"] == live_requested + _pending_requested(segments)
    assert stats["allocation.all.current"] == len(live)
    allocated = sum(s["allocated_size"] for s in segments)
    assert pool.memory_allocated() == allocated == stats["allocated_bytes.all.current"]
    assert allocated >= sum(rounded(ptr.size, rules.granule) for ptr in live)
    blocks = [b for s in segments for b in s["blocks"]]
    assert sum(b["size"] for b in blocks if b["state"] == "active_pending_free") == pending
    assert stats["active_bytes.all.current"] == allocated + pending
    assert sum(s["active_size"] for s in segments) == allocated + pending
    # Paged strategies show (and count) one segment per contiguous mapped run.
    assert stats["segment.all.current"] == len(segments)
    reserved = sum(s["total_size"] for s in segments)
    assert pool.memory_reserved() == reserved == pool.device_memory_held()
    for kind in ("large", "small"):
        of_kind = [s for s in segments if s["segment_type"] == kind]
        total = sum(s["total_size"] for s in of_kind)
        assert stats[f"reserved_bytes.{kind}_pool.current"] == total
    # A free block is "inactive split" (non-releasable) when it shares a plain segment with
    # others; free pages of an expandable range can always be unmapped.
    split_free = [
        b["size"]
        for s in segments
        if len(s["blocks"]) > 1 and not rules.page_size
        for b in s["blocks"]
        if b["state"] == "inactive"
    ]
    assert stats["inactive_split_bytes.all.current"] == sum(split_free)
    assert stats["inactive_split.all.current"] == len(split_free)
    _check_counters(stats)


def _check_ledger(stats: dict[str, int], ledger: Ledger, pending_requested: int) -> None:
    assert stats["allocation.all.allocated"] == ledger.allocations
    assert stats["allocation.all.freed"] == ledger.frees
    assert stats["requested_bytes.all.allocated"] == ledger.requested_in
    assert stats["requested_bytes.all.freed"] == ledger.requested_out - pending_requested


def _check_counters(stats: dict[str, int]) -> None:
    for name in STAT_NAMES:
        for kind in POOL_KINDS:
            key = f"{name}.{kind}."
            assert stats[key + "peak"] >= stats[key + "current"], key
        for field in ("current", "allocated", "freed"):
            parts = stats[f"{name}.large_pool.{field}"] + stats[f"{name}.small_pool.{field}"]
            assert stats[f"{name}.all.{field}"] == parts, f"{name}.*.{field}"
        large, small = stats[f"{name}.large_pool.peak"], stats[f"{name}.small_pool.peak"]
        assert max(large, small) <= stats[f"{name}.all.peak"] <= large + small, f"{name}.*.peak"
