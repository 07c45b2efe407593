"""The starting state of a recording, on generated histories: a pool running PyTorch's rules
records everything; a recording that starts at step k is undone against the final segments,
which must give exactly the pool's state at step k; replaying from there must reproduce the
recorded segment decisions and the final segments."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

import gpupool
from gpupool import _native
from gpupool._advice import fidelity, snapshot, start
from pool_checks import EXAMPLES_SCALE

MiB = 1 << 20
CONFIG = "strategy:pytorch,cross_stream_reuse:never"
# Segments listed as PyTorch lists expandable ones: a segment per contiguous mapped range, with
# segment_map and segment_unmap events for pages anywhere in them.
EXPANDABLE = "strategy:expandable,cross_stream_reuse:never"

# Sizes around PyTorch's boundaries: small (<= 1 MiB), shared 20 MiB segments, own segments.
SIZES = st.one_of(st.integers(1, 1 << 20), st.integers(1 << 20, 10 << 20), st.integers(10 << 20, 48 << 20))
OPS = st.lists(
    st.one_of(st.tuples(st.just("alloc"), SIZES), st.tuples(st.just("free"), st.integers(0, 1 << 30))),
    min_size=1,
    max_size=60,
)


def run(pool: gpupool.Pool, ops, live: list, empty_cache: bool) -> None:
    for op, value in ops:
        if op == "alloc":
            live.append(pool.alloc(value))
        elif live:
            live.pop(value % len(live)).free()
    if empty_cache:
        pool.empty_cache()


def state_of(snap: dict) -> tuple[set, set]:
    """(segments as (address, size), live blocks as (address, requested)) of a pool snapshot."""
    segments = {(s["address"], s["total_size"]) for s in snap["segments"]}
    blocks = {
        (b["address"], b["requested_size"])
        for s in snap["segments"]
        for b in s["blocks"]
        if b["state"] == "active_allocated"
    }
    return segments, blocks


def recording(before, after, flush: bool, config: str = CONFIG):
    """A pool that ran ``before``, started recording, then ran ``after``: its snapshot then,
    the final snapshot with the history since (device 0, PyTorch's format), and the most it
    reserved meanwhile."""
    pool = gpupool.Pool("sim", capacity="64GiB", config=config)
    live: list = []
    run(pool, before, live, empty_cache=flush)
    pool.record_history(max_entries=100_000)
    pool.reset_peak_memory_stats()
    then = pool.snapshot()
    run(pool, after, live, empty_cache=flush)
    return then, pool.snapshot(), pool.max_memory_reserved()


@settings(max_examples=100 * EXAMPLES_SCALE)
@given(OPS, OPS, st.booleans(), st.sampled_from([CONFIG, EXPANDABLE]))
# Cached segments and nothing recorded after: the device has segments but no history.
@example([("alloc", MiB), ("free", 0)], [("free", 0)], False, CONFIG)
def test_undoing_the_history_gives_the_state_it_began_in(before, after, flush, config):
    then, final, peak = recording(before, after, flush, config)
    [record] = snapshot.from_dict(final, "generated").devices or [None]
    if record is None:
        # No history and no segments: nothing can have been held when recording began either.
        assert (state_of(then), peak) == ((set(), set()), 0)
        return
    state = start.starting_state(record.rows, record.segments)
    assert {(s.address, s.size) for s in state.segments} == state_of(then)[0]
    assert {(b.address, b.requested) for b in state.blocks} == state_of(then)[1]
    assert state.stray_blocks == 0
    decisions = fidelity.recorded_decisions(record.rows)
    assert fidelity.recorded_peak_reserved(decisions, state.reserved_bytes) == (peak if decisions else None)


@settings(max_examples=100 * EXAMPLES_SCALE)
@given(OPS, OPS)
def test_replaying_from_the_start_reproduces_the_decisions_and_final_segments(before, after):
    then, final, _ = recording(before, after, flush=False)
    [record] = snapshot.from_dict(final, "generated").devices or [None]
    if record is None:
        assert state_of(then) == (set(), set())
        return
    state = start.starting_state(record.rows, record.segments)
    trace = _native.Trace.from_snapshot_entries(
        "generated", record.rows, [(b.address, b.requested, 0) for b in state.blocks]
    )
    segments = [(s.address, s.size, s.small, s.stream) for s in state.segments]
    result, replayed, unplaced = _native.replay_from_start(trace, CONFIG, segments, decisions=True)
    recorded = fidelity.recorded_decisions(record.rows)
    assert (replayed, unplaced) == (recorded, 0)
    final_reserved = sum(size for _, size in state_of(final)[0])
    assert result.peak_reserved_bytes == max(final_reserved, state.reserved_bytes)
