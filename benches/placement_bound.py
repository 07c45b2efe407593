"""Placement bound: the address space a trace needs when freed memory is never given back.

Usage: python benches/placement_bound.py [--ends] FILE ...      (RMM CSVs, PyTorch snapshot pickles)

A pool that keeps every page it maps (what the default does on a device that never refuses)
holds at its peak at least every page below the highest address its placement ever used. This
script measures that high water for the blocks the default puts in its large range (above
256 KiB, rounded to 512 B), placed in one unbounded address range under five rules, with
neighbours coalesced on free and no pages or handles:

- best fit (the smallest hole that holds the block, its front; the default's rule),
- first fit (the lowest hole), worst fit (the largest hole),
- best fit at the hole's back, next fit (the first hole after the last placement).

A block no hole holds goes to the top of the range. Streams are ignored (every free is reusable
at once, which only helps). Per FILE it prints the peak live bytes of those blocks, each rule's
high water rounded up to 2 MiB pages, the default's peak reserved on an unlimited device and
goal 1's bound for it (1.01x its min capacity + 20 MiB, issue 13). Where every rule's high
water is above the bound, no rule of these meets it without unmapping memory that holes hold.

With `--ends` it prints a second table instead: best fit, with the end of a hole the block
does not fill chosen by its neighbours there (END_RULES): against the larger, the smaller, the
younger (allocated later) or the older one, against the larger only where it is also the
younger or the older, or against the one closest to the block's size. The rest of the hole then
lies next to the other neighbour, and merges when that one is freed.

For contrast it also places the same blocks with foresight, as a static memory planner does
before a run: largest first, each at the lowest address free for its whole lifetime (greedy by
size). No pool can do that, because it sees a block's size and lifetime only as they come; the
column says how much of a rule's high water is for not knowing the future.
"""

from __future__ import annotations

import argparse
import bisect
import os
from collections.abc import Iterable

from gpupool.trace import Event, load, replay

MiB = 1 << 20
PAGE = 2 * MiB
GRANULE = 512
TINY = 256 << 10
RULES = ("best fit", "first fit", "worst fit", "best fit, back", "next fit")
END_RULES = ("larger", "smaller", "younger", "older", "larger and younger", "larger and older", "closest size")


def against_high(rule: str, size: int, low: tuple[int, int] | None, high: tuple[int, int] | None) -> bool:
    """Whether a block of `size` goes to the back of a hole, against `high` (the live block
    after it) rather than `low` (the one before, `None` at address 0); each is (size, serial)."""
    if high is None:
        return False
    low_size, low_serial = low if low is not None else (1 << 62, -1)
    larger = high[0] > low_size
    if rule == "larger":
        return larger
    if rule == "smaller":
        return high[0] < low_size
    if rule == "younger":
        return high[1] > low_serial
    if rule == "older":
        return high[1] < low_serial
    if rule == "larger and younger":
        return larger and high[1] > low_serial
    if rule == "larger and older":
        return larger and high[1] < low_serial
    if rule == "closest size":
        return abs(high[0] - size) < abs(low_size - size)
    raise ValueError(f"unknown end rule {rule!r}")


class AddressSpace:
    """Free holes below `top`, by address; everything from `top` up is free."""

    def __init__(self, rule: str) -> None:
        self.rule = rule
        self.holes: list[tuple[int, int]] = []  # (start, length), coalesced
        self.top = 0
        self.high_water = 0
        self.cursor = 0
        # Live blocks as (size, serial), by start and by end: the END_RULES' neighbours.
        self.starting: dict[int, tuple[int, int]] = {}
        self.ending: dict[int, tuple[int, int]] = {}
        self.serial = 0

    def place(self, size: int) -> int:
        at = self.choose(size)
        self.serial += 1
        self.starting[at] = self.ending[at + size] = (size, self.serial)
        return at

    def choose(self, size: int) -> int:
        fits = [(i, start, length) for i, (start, length) in enumerate(self.holes) if length >= size]
        if not fits:
            return self.place_on_top(size)
        if self.rule == "first fit":
            i, start, length = fits[0]
        elif self.rule == "worst fit":
            i, start, length = max(fits, key=lambda f: (f[2], -f[1]))
        elif self.rule == "next fit":
            after = [f for f in fits if f[1] >= self.cursor]
            i, start, length = after[0] if after else fits[0]
        else:
            i, start, length = min(fits, key=lambda f: (f[2], f[1]))
        del self.holes[i]
        if self.rule in END_RULES:
            back = against_high(self.rule, size, self.ending.get(start), self.starting.get(start + length))
        else:
            back = self.rule == "best fit, back"
        at = start + length - size if back else start
        if at > start:
            bisect.insort(self.holes, (start, at - start))
        if at + size < start + length:
            bisect.insort(self.holes, (at + size, start + length - at - size))
        self.cursor = at
        return at

    def place_on_top(self, size: int) -> int:
        # No hole reaches the top: a free there lowers the top instead.
        at = self.top
        self.top = at + size
        self.high_water = max(self.high_water, self.top)
        self.cursor = at
        return at

    def free(self, at: int, size: int) -> None:
        del self.starting[at], self.ending[at + size]
        i = bisect.bisect(self.holes, (at, 0))
        start, end = at, at + size
        if i < len(self.holes) and self.holes[i][0] == end:
            end = sum(self.holes.pop(i))
        if i > 0 and sum(self.holes[i - 1]) == start:
            start = self.holes.pop(i - 1)[0]
        if end == self.top:
            self.top = start
        else:
            bisect.insort(self.holes, (start, end - start))


def high_waters(events: Iterable[Event], rules: tuple[str, ...] = RULES) -> tuple[int, dict[str, int]]:
    """Peak live bytes of the large-range blocks, and each rule's high water in bytes."""
    spaces = {rule: AddressSpace(rule) for rule in rules}
    placed: dict[int, tuple[int, dict[str, int]]] = {}
    live = peak = 0
    for event in events:
        if event.action == "alloc":
            size = -(-event.size // GRANULE) * GRANULE
            if size <= TINY:
                continue
            placed[event.address] = (size, {rule: space.place(size) for rule, space in spaces.items()})
            live += size
            peak = max(peak, live)
        elif event.action == "free" and event.address in placed:
            size, where = placed.pop(event.address)
            for rule, space in spaces.items():
                space.free(where[rule], size)
            live -= size
    return peak, {rule: space.high_water for rule, space in spaces.items()}


def lifetimes(events: Iterable[Event]) -> list[tuple[int, int, int]]:
    """The large-range blocks as (first event, event that frees it or the trace's end, size)."""
    born: dict[int, tuple[int, int]] = {}
    blocks = []
    count = 0
    for count, event in enumerate(events, 1):
        if event.action == "alloc":
            size = -(-event.size // GRANULE) * GRANULE
            if size > TINY:
                born[event.address] = (count - 1, size)
        elif event.action == "free" and event.address in born:
            start, size = born.pop(event.address)
            blocks.append((start, count - 1, size))
    blocks.extend((start, count, size) for start, size in born.values())
    return blocks


def plan_with_foresight(blocks: list[tuple[int, int, int]], bucket: int = 256) -> list[int]:
    """Each block's address under greedy by size: largest first (earliest first among equals),
    each at the lowest address no block placed before it uses during its lifetime. Placed blocks
    are indexed by the buckets of `bucket` events their lifetimes span, to find the overlaps."""
    at = [0] * len(blocks)
    index: dict[int, list[int]] = {}
    for i in sorted(range(len(blocks)), key=lambda i: (-blocks[i][2], blocks[i][0])):
        start, end, size = blocks[i]
        spanned = range(start // bucket, max(start, end - 1) // bucket + 1)
        taken = sorted(
            {
                (at[j], at[j] + blocks[j][2])
                for k in spanned
                for j in index.get(k, ())
                if blocks[j][0] < end and start < blocks[j][1]
            }
        )
        for low, high in taken:
            if at[i] + size <= low:
                break
            at[i] = max(at[i], high)
        for k in spanned:
            index.setdefault(k, []).append(i)
    return at


def high_water_with_foresight(blocks: list[tuple[int, int, int]]) -> int:
    """The top of `plan_with_foresight`'s layout, in bytes."""
    return max((at + size for at, (_, _, size) in zip(plan_with_foresight(blocks), blocks, strict=True)), default=0)


def pages(water: int) -> str:
    """`water` bytes rounded up to 2 MiB pages, in MiB."""
    return f"{-(-water // PAGE) * PAGE / MiB:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--ends", action="store_true", help="best fit with each of END_RULES instead")
    args = parser.parse_args()
    rules = ("best fit", *END_RULES) if args.ends else RULES
    tail = ["bound"] if args.ends else ["with foresight", "default, peak reserved", "bound"]
    print("| trace (MiB) | peak live | " + " | ".join([*rules, *tail]) + " |")
    print("|---|---:|" + "---:|" * (len(rules) + len(tail)))
    for path in args.files:
        trace = load(path)
        peak, waters = high_waters(trace, rules)
        least = replay(trace, "strategy:default", min_capacity=True).min_capacity_bytes or 0
        cells = [pages(waters[rule]) for rule in rules]
        if not args.ends:
            cells.append(pages(high_water_with_foresight(lifetimes(trace))))
            cells.append(f"{replay(trace, 'strategy:default').peak_reserved_bytes / MiB:,.0f}")
        cells.append(f"{(1.01 * least + 20 * MiB) / MiB:,.1f}")
        name = os.path.basename(path).split(".")[0][:48]
        print(f"| {name} | {peak / MiB:,.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
