"""The starting state of a recording: the history undone against the final segments.

Recording usually starts mid-run, after a warm-up. What existed then follows from the final
state and the history, address by address: a segment whose first event is ``segment_free``
existed (with that size), one whose first event is ``segment_alloc`` did not, one the history
never touches existed if it exists at the end. The same goes for blocks: one whose first event
is a ``free_completed`` was live at the start, one whose first is an ``alloc`` was not, and a
live block the history never touches was live all along.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def _first_events(rows: Sequence[Row]) -> tuple[dict[int, Row], dict[int, Row]]:
    """Per address, the first segment event and the first block event (alloc or completed free)."""
    segments: dict[int, Row] = {}
    blocks: dict[int, Row] = {}
    for row in rows:
        action, address = row[0], row[1]
        if action in SEGMENT_ACTIONS:
            segments.setdefault(address, row)
        elif action in ("alloc", "free_completed"):
            blocks.setdefault(address, row)
    return segments, blocks


def starting_state(rows: Sequence[Row], final: Sequence[Segment]) -> StartState:
    """Undoes ``rows`` (one device's history, oldest first) against its ``final`` segments."""
    first_segment, first_block = _first_events(rows)
    final_by_address = {s.address: s for s in final}
    segments = []
    for s in final:
        if s.address not in first_segment:
            segments.append(StartSegment(s.address, s.size, s.small, s.stream))
    for address, (action, _, size, stream, _) in first_segment.items():
        if action == "segment_free":
            known = final_by_address.get(address)
            small = known.small if known is not None and known.size == size else size <= SMALL_SEGMENT
            segments.append(StartSegment(address, size, small, stream))
    segments.sort(key=lambda s: s.address)
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
