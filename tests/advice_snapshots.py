"""Shared by the advice tests: the real snapshots' paths, and hand-made PyTorch snapshots."""

from __future__ import annotations

import pathlib
import pickle
from typing import Any

import pytest

MiB = 1 << 20
SHARED_SNAPSHOTS = pathlib.Path(__file__).resolve().parent.parent.parent / "shared" / "snapshots"
WITH_SEGMENT_EVENTS = "kkaitlyn111__memory_files_memory_ctx128_forward_.pickle"
# From shared/snapshots/README.md: the four files with final segments and no history.
SEGMENTS_ONLY = (
    "LLM-inference__1.3b_snapshot_08fa910.pickle",
    "LLM-inference__1.3b_snapshot_a228b8e.pickle",
    "LLM-inference__oom_snapshot.pickle",
    "SketchKV2__my_snapshot.pickle",
)
BASE = 0x7F00_0000_0000


def shared_snapshot(name: str) -> pathlib.Path:
    path = SHARED_SNAPSHOTS / name
    if not path.exists():
        pytest.skip(f"{path} is absent (the shared snapshots live beside the repository)")
    return path


def shared_names() -> list[str]:
    return sorted(p.name for p in SHARED_SNAPSHOTS.glob("*.pickle"))


def entry(action: str, addr: int, size: int, time_us: int | None = 0, **more: Any) -> dict[str, Any]:
    e = {"action": action, "addr": addr, "size": size, "stream": 0, **more}
    if time_us is not None:
        e["time_us"] = time_us
    return e


def block(address: int, size: int, requested: int, state: str) -> dict[str, Any]:
    return {"address": address, "size": size, "requested_size": requested, "state": state, "frames": []}


def segment(address: int, size: int, blocks: list[dict[str, Any]], device: int = 0) -> dict[str, Any]:
    return {
        "device": device,
        "address": address,
        "total_size": size,
        "stream": 0,
        "segment_type": "small" if size <= 2 * MiB else "large",
        "is_expandable": False,
        "blocks": blocks,
    }


def warmed_up(device: int = 0, time_us: bool = True) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A job recorded after warm-up: a 64 MiB segment holds a 4 MiB block allocated before
    recording and cached free space; the history allocates 40 MiB into it, frees the old block,
    grows a 24 MiB segment for a 24 MiB request (no free block is that big) and frees it, as
    PyTorch's allocator decides. Returns (entries, final segments)."""
    t = (lambda n: n) if time_us else (lambda n: None)
    cached, grown = BASE + device * (1 << 36), BASE + device * (1 << 36) + (1 << 30)
    entries = [
        entry("alloc", cached + 4 * MiB, 40 * MiB, t(1), frames=[{"filename": "train.py", "line": 7, "name": "step"}]),
        entry("free_requested", cached, 4 * MiB, t(2)),
        entry("free_completed", cached, 4 * MiB, t(3)),
        entry("segment_alloc", grown, 24 * MiB, t(4)),
        entry("alloc", grown, 24 * MiB, t(5), frames=[{"filename": "train.py", "line": 9, "name": "step"}]),
        entry("free_requested", grown, 24 * MiB, t(6)),
        entry("free_completed", grown, 24 * MiB, t(7)),
    ]
    segments = [
        segment(
            cached,
            64 * MiB,
            [
                block(cached, 4 * MiB, 0, "inactive"),
                block(cached + 4 * MiB, 40 * MiB, 40 * MiB, "active_allocated"),
                block(cached + 44 * MiB, 20 * MiB, 0, "inactive"),
            ],
            device,
        ),
        segment(grown, 24 * MiB, [block(grown, 24 * MiB, 0, "inactive")], device),
    ]
    return entries, segments


def write(tmp_path: pathlib.Path, snapshot: dict[str, Any], name: str = "job.pickle") -> pathlib.Path:
    path = tmp_path / name
    path.write_bytes(pickle.dumps(snapshot))
    return path


def write_deeply_nested(tmp_path: pathlib.Path, snapshot: dict[str, Any], depth: int = 100_000) -> pathlib.Path:
    """``snapshot`` pickled with its one string "DEEP" replaced by a list nested ``depth`` deep,
    which Python's own pickler would recurse too far to write."""
    marker = b"X\x04\x00\x00\x00DEEP"  # protocol 2's BINUNICODE "DEEP"
    data = pickle.dumps(snapshot, protocol=2)
    assert data.count(marker) == 1
    path = tmp_path / "deep.pickle"
    path.write_bytes(data.replace(marker, b"]" * depth + b"a" * (depth - 1)))
    return path
