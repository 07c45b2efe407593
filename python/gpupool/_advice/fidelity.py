"""How closely a replay of the recorded settings matches the recorded run: the recorded peak
reserved bytes (from the snapshot's own segment events) against the replayed peak, and the
share of the allocator's segment decisions the replay made alike and in the same order."""

from __future__ import annotations

from collections.abc import Sequence

from gpupool import _native
from gpupool._advice.snapshot import SEGMENT_ACTIONS, Row

# Myers' search gives up past this many differences (its cost grows with them); the share is
# then reported as unknown rather than guessed.
MAX_EDITS = 50_000
_GROWS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def recorded_decisions(rows: Sequence[Row]) -> list[tuple[str, int]]:
    return [(row[0], row[2]) for row in rows if row[0] in SEGMENT_ACTIONS]


def recorded_peak_reserved(decisions: Sequence[tuple[str, int]], start_reserved: int) -> int | None:
    """Reserved bytes at their highest, from the starting segments and the segment events."""
    if not decisions:
        return None
    reserved = peak = start_reserved
    for action, size in decisions:
        reserved += _GROWS[action] * size
        peak = max(peak, reserved)
    return peak


def matched(recorded: Sequence[tuple[str, int]], replayed: Sequence[tuple[str, int]]) -> float | None:
    """The share of ``recorded`` decisions ``replayed`` made alike and in order; ``None`` when
    nothing was recorded or the two differ too much to count."""
    if not recorded:
        return None
    common = _native.matched_in_order(list(recorded), list(replayed), MAX_EDITS)
    return None if common is None else common / len(recorded)
