"""The native walks over a snapshot history (``rust/trace/rows.rs``) against the plain Python
walks they replaced, on random histories: reused and null addresses, frees of blocks live
before recording and of addresses never allocated, rows of other actions."""

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
    """The walk `sites.at_peak` made: the peak's count leaves out frees of start blocks."""
    sizes: dict = {}
    live = best = sum(size for size in dict(start).values())
    peak = -1
    for index, (action, address, size, _, _) in enumerate(rows):
        if action == "alloc":
            sizes[address] = size
            live += size
            if live > best:
                best, peak = live, index
        elif action == "free_completed":
            live -= sizes.pop(address, 0)
    blocks = {address: (None, size) for address, size in start}
    for index, (action, address, size, _, _) in enumerate(rows[: peak + 1]):
        if action == "alloc":
            blocks[address] = (index, size)
        elif action == "free_completed":
            blocks.pop(address, None)
    return sorted(((row, address, size) for address, (row, size) in blocks.items()), key=lambda b: b[1])


@settings(max_examples=300 * EXAMPLES_SCALE)
@given(ROWS, START)
def test_the_native_walks_find_what_the_python_ones_found(rows, start):
    assert _native.first_block_rows(rows) == first_block_rows(rows)
    assert _native.live_at_peak(rows, start) == live_at_peak(rows, start)


def test_the_peak_is_where_the_count_first_reached_its_highest():
    rows = [("alloc", 0x100, 8, 0, 0.0), ("free_completed", 0x100, 8, 0, 0.0), ("alloc", 0x200, 8, 0, 0.0)]
    assert _native.live_at_peak(rows, []) == [(0, 0x100, 8)]
    assert _native.live_at_peak(rows[1:], [(0x100, 8)]) == [(1, 0x200, 8)]
