"""The starting state of a recording: the history undone against the final segments.

Recording usually starts mid-run, after a warm-up. What existed then follows from the final
state and the history. Segments: the segment events undone newest first; a ``segment_alloc``
made its segment, a ``segment_free`` removed one of that size. An expandable segment is listed
as one segment per contiguous mapped range, and its ``segment_map`` and ``segment_unmap``
cover pages anywhere in it: undoing a map cuts its pages out of the range holding them, undoing
an unmap puts them back beside the ranges they adjoin. Blocks, address by address: one whose
first event is a ``free_completed`` was live at the start, one whose first is an ``alloc`` was
not, and a live block the history never touches was live all along.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpupool import _native
from gpupool._advice.snapshot import SEGMENT_ACTIONS, SMALL_SEGMENT, Row, Segment


@dataclass(frozen=True)
class StartBlock:
    address: int
    requested: int
    stream: int


@dataclass(frozen=True)
class StartSegment:
    address: int
    size: int
    small: bool
    stream: int


@dataclass
class StartState:
    segments: list[StartSegment]
    # In address order: the allocations a replay makes (or places) before the history.
    blocks: list[StartBlock]
    # Live blocks at the start that lie in no start segment: the snapshot contradicts itself.
    stray_blocks: int

    @property
    def reserved_bytes(self) -> int:
        return sum(s.size for s in self.segments)


def _first_block_events(rows: list[Row]) -> dict[int, Row]:
    """Per address, the first block event (alloc or completed free)."""
    # Found natively: the walk over every row took half a second in Python on a million rows.
    return {rows[index][1]: rows[index] for index in _native.first_block_rows(rows)}


def _cut(mapped: list[StartSegment], address: int, size: int) -> list[StartSegment]:
    """``mapped`` without the bytes ``[address, address + size)``."""
    end, kept = address + size, []
    for r in mapped:
        if r.address < end and address < r.address + r.size:
            if r.address < address:
                kept.append(StartSegment(r.address, address - r.address, r.small, r.stream))
            if end < r.address + r.size:
                kept.append(StartSegment(end, r.address + r.size - end, r.small, r.stream))
        else:
            kept.append(r)
    return kept


def _join(mapped: list[StartSegment], address: int, size: int, stream: int) -> list[StartSegment]:
    """``mapped`` with the bytes ``[address, address + size)`` of ``stream``, one range with the
    ranges of that stream they adjoin."""
    kept, beside, start, end = [], [], address, address + size
    for r in _cut(mapped, address, size):
        if r.stream == stream and (r.address + r.size == start or r.address == end):
            beside.append(r)
            start, end = min(start, r.address), max(end, r.address + r.size)
        else:
            kept.append(r)
    small = beside[0].small if beside else size <= SMALL_SEGMENT
    return [*kept, StartSegment(start, end - start, small, stream)]


def _segments_at_start(rows: Sequence[Row], final: Sequence[Segment]) -> list[StartSegment]:
    """The ``final`` segments with the segment events of ``rows`` undone, newest first."""
    final_by_address = {s.address: s for s in final}
    plain = {s.address: StartSegment(s.address, s.size, s.small, s.stream) for s in final if not s.expandable}
    mapped = [StartSegment(s.address, s.size, s.small, s.stream) for s in final if s.expandable]
    for action, address, size, stream, _ in reversed([r for r in rows if r[0] in SEGMENT_ACTIONS]):
        if action == "segment_alloc":
            plain.pop(address, None)
        elif action == "segment_free":
            known = final_by_address.get(address)
            small = known.small if known is not None and known.size == size else size <= SMALL_SEGMENT
            plain[address] = StartSegment(address, size, small, stream)
        elif action == "segment_map":
            mapped = _cut(mapped, address, size)
        else:
            mapped = _join(mapped, address, size, stream)
    return sorted([*plain.values(), *mapped], key=lambda s: s.address)


def starting_state(rows: list[Row], final: Sequence[Segment]) -> StartState:
    """Undoes ``rows`` (one device's history, oldest first) against its ``final`` segments."""
    first_block = _first_block_events(rows)
    segments = _segments_at_start(rows, final)
    blocks = [
        StartBlock(address, size, stream)
        for address, (action, _, size, stream, _) in first_block.items()
        if action == "free_completed"
    ]
    for s in final:
        blocks.extend(
            StartBlock(b.address, b.requested, s.stream) for b in s.blocks if b.live and b.address not in first_block
        )
    blocks.sort(key=lambda b: b.address)
    return StartState(segments, blocks, _strays(segments, blocks))


def _strays(segments: Sequence[StartSegment], blocks: Sequence[StartBlock]) -> int:
    """Blocks (sorted by address) outside every segment (sorted by address)."""
    strays, index = 0, 0
    for b in blocks:
        while index < len(segments) and segments[index].address + segments[index].size <= b.address:
            index += 1
        inside = index < len(segments) and segments[index].address <= b.address
        if not inside or b.address + b.requested > segments[index].address + segments[index].size:
            strays += 1
    return strays
