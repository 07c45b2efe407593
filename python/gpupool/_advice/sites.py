"""Allocation sites: the recorded stack frame that names the user's code behind an allocation, and
which sites hold the most memory at the peak."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

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


def _peak_index(rows: Sequence[Row], live_at_start: int) -> int:
    """The index of the row after which the most requested bytes were live (-1: the start)."""
    sizes: dict[int, int] = {}
    live = best = live_at_start
    at = -1
    for index, (action, address, size, _, _) in enumerate(rows):
        if action == "alloc":
            sizes[address] = size
            live += size
            if live > best:
                best, at = live, index
        elif action == "free_completed":
            live -= sizes.pop(address, 0)
    return at


def at_peak(
    rows: Sequence[Row],
    frames: Mapping[int, Sequence[Any]],
    start_blocks: Iterable[tuple[int, int, Sequence[Any]]],
    limit: int,
) -> list[tuple[str, int]]:
    """The ``limit`` sites holding the most requested bytes when the most were live.
    ``start_blocks`` are the blocks live when recording began, as (address, size, frames)."""
    start = {address: (size, stack) for address, size, stack in start_blocks}
    # Pass one finds the peak; pass two rebuilds what was live there (cheaper than copying).
    peak = _peak_index(rows, sum(size for size, _ in start.values()))
    live: dict[int, tuple[int, Sequence[Any]]] = dict(start)
    for index in range(peak + 1):
        action, address, size = rows[index][:3]
        if action == "alloc":
            live[address] = (size, frames.get(index, ()))
        elif action == "free_completed":
            live.pop(address, None)
    held: dict[str, int] = {}
    for address, (size, stack) in live.items():
        key = BEFORE_RECORDING if not stack and address in start else site(stack)
        held[key] = held.get(key, 0) + size
    return sorted(held.items(), key=lambda item: (-item[1], item[0]))[:limit]
