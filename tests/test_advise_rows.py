"""The native walks over a snapshot history (``rust/trace/rows.rs``) against plain Python walks,
on random histories: reused and null addresses, frees of blocks live before recording and of
addresses never allocated, rows of other actions."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool import _native
from pool_checks import EXAMPLES_SCALE

ADDRESSES = st.sampled_from([0, 0x100, 0x200, 0x300, 2**64 - 1])
SIZES = st.one_of(st.integers(0, 64), st.just(2**64 - 1))
ROWS = st.lists(
    st.tuples(st.sampled_from(["alloc", "free_completed", "segment_alloc", "oom"]), ADDRESSES, SIZES, st.just(0)).map(
        lambda r: (*r, 0.0)
    ),
    max_size=40,
)
START = st.lists(st.tuples(ADDRESSES, SIZES), max_size=4)


def first_block_rows(rows) -> list[int]:
    first: dict = {}
    for index, (action, address, *_) in enumerate(rows):
        if action in ("alloc", "free_completed"):
            first.setdefault(address, index)
    return list(first.values())


def live_at_peak(rows, start) -> list:
    """The live blocks, by address, the first time their sizes added up to the most."""
    blocks = {address: (None, size) for address, size in start}
    best, peak = dict(blocks), sum(size for _, size in blocks.values())
    for index, (action, address, size, _, _) in enumerate(rows):
        if action == "alloc":
            blocks[address] = (index, size)
            live = sum(size for _, size in blocks.values())
            if live > peak:
                best, peak = dict(blocks), live
        elif action == "free_completed":
            blocks.pop(address, None)
    return sorted(((row, address, size) for address, (row, size) in best.items()), key=lambda b: b[1])


@settings(max_examples=300 * EXAMPLES_SCALE)
@given(ROWS, START)
def test_the_native_walks_match_a_plain_recount(rows, start):
    assert _native.first_block_rows(rows) == first_block_rows(rows)
    assert _native.live_at_peak(rows, start) == live_at_peak(rows, start)


def test_the_peak_is_where_the_count_first_reached_its_highest():
    rows = [("alloc", 0x100, 8, 0, 0.0), ("free_completed", 0x100, 8, 0, 0.0), ("alloc", 0x200, 8, 0, 0.0)]
    assert _native.live_at_peak(rows, []) == [(0, 0x100, 8)]
    assert _native.live_at_peak(rows[1:], [(0x100, 8)]) == [(None, 0x100, 8)]
    # A block live before recording, freed, counts no more: the peak is after the second alloc.
    rows = [("free_completed", 0x100, 8, 0, 0.0), ("alloc", 0x200, 8, 0, 0.0), ("alloc", 0x300, 4, 0, 0.0)]
    assert _native.live_at_peak(rows, [(0x100, 8)]) == [(1, 0x200, 8), (2, 0x300, 4)]
