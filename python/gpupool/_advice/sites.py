"""Allocation sites: the recorded stack frame that names the user's code behind an allocation, and
which sites hold the most memory at the peak."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpupool import _native
from gpupool._advice.snapshot import Row

# Frames of libraries and the interpreter: the site is the innermost Python frame past them.
_LIBRARY_PARTS = ("/torch/", "\\torch\\", "site-packages", "dist-packages", "<frozen", "/lib/python")
UNKNOWN = "(no Python frame recorded)"
BEFORE_RECORDING = "(allocated before recording began)"


def site(frames: Sequence[Any]) -> str:
    """``file:line (function)`` of the innermost frame in the user's own Python code, else of
    the innermost Python frame, else a placeholder."""
    fallback = None
    for frame in frames:
        if not isinstance(frame, Mapping):
            continue
        filename, line, name = frame.get("filename"), frame.get("line"), frame.get("name")
        # C++ frames (the allocator, ATen, the interpreter loop) name .cpp, .so, ?? or nothing.
        if not isinstance(filename, str) or not (filename.endswith(".py") or filename.startswith("<ipython")):
            continue
        text = f"{filename}:{line} ({name})"
        if not any(part in filename for part in _LIBRARY_PARTS):
            return text
        fallback = fallback or text
    return fallback or UNKNOWN


def at_peak(
    rows: list[Row],
    frames: Mapping[int, Sequence[Any]],
    start_blocks: Sequence[tuple[int, int, Sequence[Any]]],
    limit: int,
) -> list[tuple[str, int]]:
    """The ``limit`` sites holding the most requested bytes when the most were live.
    ``start_blocks`` are the blocks live when recording began, as (address, size, frames)."""
    start = {address: stack for address, _, stack in start_blocks}
    # Natively: a walk over every row, twice, took a second in Python on a million rows.
    live = _native.live_at_peak(rows, [(address, size) for address, size, _ in start_blocks])
    held: dict[str, int] = {}
    for row, address, size in live:
        stack = start[address] if row is None else frames.get(row, ())
        key = BEFORE_RECORDING if not stack and address in start else site(stack)
        held[key] = held.get(key, 0) + size
    return sorted(held.items(), key=lambda item: (-item[1], item[0]))[:limit]
