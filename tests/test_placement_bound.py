"""benches/placement_bound.py's address-space model: each rule places where it says, never over
a live block, coalesces every free, and its high water bounds what a pool that keeps its pages
holds. And the claim BENCHMARKS.md makes with it on bert_serve_varbatch."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import bench_scripts
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupool.trace import Event, load, replay

SHARED = Path(__file__).resolve().parents[2] / "shared"
placement_bound = bench_scripts.load("placement_bound")
AddressSpace, RULES, END_RULES = placement_bound.AddressSpace, placement_bound.RULES, placement_bound.END_RULES

MiB = 1 << 20


def space_with_holes(rule: str, sizes: list[int], freed: list[int]) -> tuple[AddressSpace, list[int]]:
    """Blocks of `sizes` placed on top of each other, then those at indices `freed` freed."""
    space = AddressSpace(rule)
    at = [space.place(size) for size in sizes]
    for i in freed:
        space.free(at[i], sizes[i])
    return space, at


@pytest.mark.parametrize(
    ("rule", "expected"),
    [("best fit", 10), ("first fit", 0), ("worst fit", 20), ("best fit, back", 11), ("next fit", 20)],
)
def test_each_rule_picks_its_hole(rule, expected):
    # Holes of 4 at 0, 2 at 10 and 9 at 20 between live blocks.
    space, _ = space_with_holes(rule, [4, 6, 2, 8, 9, 1], [0, 2, 4])
    space.cursor = 15  # as if the last placement was at 15
    assert space.place(1) == expected


def test_a_block_no_hole_holds_goes_on_top_and_raises_the_high_water():
    space, _ = space_with_holes("best fit", [4, 1, 4], [0, 2])
    # Freeing the top block lowered the top: the 4 at 5 left no hole.
    assert (space.holes, space.top, space.high_water) == ([(0, 4)], 5, 9)
    assert space.place(5) == 5
    assert (space.top, space.high_water) == (10, 10)


def hole_between(rule: str, low_size: int, high_size: int, low_younger: bool) -> AddressSpace:
    """A hole of 4 at `low_size` between a live block of `low_size` at 0 and one of `high_size`,
    the one below placed before the one above or, with `low_younger`, after it."""
    space, at = space_with_holes("best fit", [low_size, 4, high_size], [1, 0] if low_younger else [1])
    if low_younger:
        assert space.place(low_size) == at[0]
    space.rule = rule
    return space


@pytest.mark.parametrize(
    ("rule", "older_small_low", "older_large_low", "younger_small_low"),
    [
        ("larger", "back", "front", "back"),
        ("smaller", "front", "back", "front"),
        ("younger", "back", "back", "front"),
        ("older", "front", "front", "back"),
        ("larger and younger", "back", "front", "front"),
        ("larger and older", "front", "front", "back"),
        ("closest size", "front", "back", "front"),
    ],
)
def test_each_end_rule_picks_its_end_of_the_hole(rule, older_small_low, older_large_low, younger_small_low):
    # A block of 2 in a hole of 4 at 1: its front is 1, its back 3. Above the hole a block of 3,
    # or of 1 where the block below is of 5 (then the hole is at 5: front 5, back 7).
    cases = [(1, 3, False, older_small_low), (5, 1, False, older_large_low), (1, 3, True, younger_small_low)]
    for low_size, high_size, low_younger, end in cases:
        space = hole_between(rule, low_size, high_size, low_younger)
        assert space.holes == [(low_size, 4)]
        assert space.place(2) == low_size + (0 if end == "front" else 2), (low_size, high_size, low_younger)


programs = st.lists(
    st.tuples(st.booleans(), st.integers(min_value=1, max_value=64), st.integers(min_value=0, max_value=10**6)),
    max_size=120,
)


@pytest.mark.parametrize("rule", RULES + END_RULES)
@given(program=programs)
def test_placements_never_overlap_and_frees_coalesce(rule, program):
    space, live, peak = AddressSpace(rule), {}, 0
    for alloc, size, pick in program:
        if alloc or not live:
            at = space.place(size)
            assert all(at + size <= start or start + length <= at for start, length in live.items())
            live[at] = size
            peak = max(peak, sum(live.values()))
        else:
            at = sorted(live)[pick % len(live)]
            space.free(at, live.pop(at))
        assert max((start + length for start, length in live.items()), default=0) <= space.top <= space.high_water
        # The holes are exactly the free space below the top, coalesced.
        covered = sorted([(s, s + n) for s, n in live.items()] + [(s, s + n) for s, n in space.holes])
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in pairwise(covered))
        assert all(a + n < b for (a, n), (b, _) in pairwise(space.holes))
        assert sum(n for _, n in space.holes) + sum(live.values()) == space.top
    assert space.high_water >= peak
    for at, size in list(live.items()):
        space.free(at, size)
    assert (space.holes, space.top) == ([], 0)


def test_high_waters_count_only_the_large_range_blocks():
    events = [
        Event("alloc", 1, 4 * MiB, 0, 0.0),
        Event("alloc", 2, 256 << 10, 0, 0.0),  # tiny: the default's small range
        Event("alloc", 3, 1 * MiB, 0, 0.0),
        Event("free", 1, 4 * MiB, 0, 0.0),
        Event("alloc", 4, 5 * MiB, 0, 0.0),
    ]
    peak, waters = placement_bound.high_waters(events)
    assert peak == 6 * MiB
    assert waters == dict.fromkeys(RULES, 10 * MiB)


def events_of(program: list[tuple[bool, int, int]]) -> list[Event]:
    """A trace of large-range blocks (sizes in MiB) from a program of (alloc?, size, pick)."""
    events, live, next_address = [], [], 1
    for alloc, size, pick in program:
        if alloc or not live:
            events.append(Event("alloc", next_address, size * MiB, 0, 0.0))
            live.append((next_address, size * MiB))
            next_address += 1
        else:
            address, size = live.pop(pick % len(live))
            events.append(Event("free", address, size, 0, 0.0))
    return events


@given(program=programs)
def test_the_plan_with_foresight_never_overlaps_and_rests_each_block_on_another(program):
    events = events_of(program)
    blocks = placement_bound.lifetimes(events)
    at = placement_bound.plan_with_foresight(blocks, bucket=3)
    assert len(blocks) == sum(event.action == "alloc" for event in events)

    def meet(i, j):
        return blocks[i][0] < blocks[j][1] and blocks[j][0] < blocks[i][1]

    for i, (_, _, size) in enumerate(blocks):
        others = [j for j in range(len(blocks)) if j != i and meet(i, j)]
        assert all(at[i] + size <= at[j] or at[j] + blocks[j][2] <= at[i] for j in others)
        # Greedy: it sits at 0 or right on top of a larger (or as large) block of its lifetime.
        assert at[i] == 0 or any(at[j] + blocks[j][2] == at[i] and blocks[j][2] >= size for j in others)
    peak, _ = placement_bound.high_waters(events)
    assert placement_bound.high_water_with_foresight(blocks) == max(
        (a + b[2] for a, b in zip(at, blocks, strict=True)), default=0
    )
    assert placement_bound.high_water_with_foresight(blocks) >= peak


def test_foresight_puts_a_long_lived_block_above_a_larger_one_still_to_come():
    # b outlives a hole that c, larger and later, cannot use: online, c goes on top (4 MiB);
    # knowing c comes, b goes above where c will be (3 MiB).
    events = [
        Event("alloc", 1, 1 * MiB, 0, 0.0),
        Event("alloc", 2, 1 * MiB, 0, 0.0),
        Event("free", 1, 1 * MiB, 0, 0.0),
        Event("alloc", 3, 2 * MiB, 0, 0.0),
    ]
    blocks = placement_bound.lifetimes(events)
    assert blocks == [(0, 2, MiB), (1, 4, MiB), (3, 4, 2 * MiB)]
    assert placement_bound.plan_with_foresight(blocks) == [0, 2 * MiB, 0]
    assert placement_bound.high_waters(events)[1] == dict.fromkeys(RULES, 4 * MiB)


@pytest.mark.skipif(not (SHARED / "traces").is_dir(), reason="../shared is absent")
def test_only_foresight_keeps_bert_serve_varbatch_under_goal_1s_peak_bound():
    # Neither a rule that picks the hole nor one that picks the end of a best-fit hole does.
    trace = load(SHARED / "traces" / "bert_serve_varbatch.csv.gz")
    least = replay(trace, "strategy:default", min_capacity=True).min_capacity_bytes
    _, waters = placement_bound.high_waters(trace, RULES + END_RULES)
    bound = 1.01 * least + 20 * MiB
    assert min(waters.values()) > bound
    planned = placement_bound.high_water_with_foresight(placement_bound.lifetimes(trace))
    assert -(-planned // (2 * MiB)) * 2 * MiB <= bound
