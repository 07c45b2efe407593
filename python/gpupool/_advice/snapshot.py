"""A snapshot as advice reads it: per device, the history entries, the final segments and their
blocks, and where each allocation was made; read from plain data only, never run."""

from __future__ import annotations

import os
import reprlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from operator import itemgetter
from typing import Any

from gpupool import trace as _trace
from gpupool.trace import KNOWN_ACTIONS

Row = tuple[str, int, int, int, float]

SEGMENT_ACTIONS = frozenset(("segment_alloc", "segment_free", "segment_map", "segment_unmap"))
SMALL_SEGMENT = 2 << 20


@dataclass
class Block:
    address: int
    size: int
    requested: int
    live: bool
    frames: Sequence[Any] = ()
    # Lists the allocations last made in it (see `trace._carries_history`): not replayed.
    carries_history: bool = False


@dataclass
class Segment:
    address: int
    size: int
    small: bool
    stream: int
    expandable: bool
    blocks: list[Block] = field(default_factory=list)
    # In a private pool (a CUDA graph's), whose free space serves only that pool.
    private: bool = False


@dataclass
class DeviceRecord:
    """One device's part of a snapshot."""

    device: int
    rows: list[Row]
    # The recorded stack frames of each row that has some (by row index).
    frames: dict[int, Sequence[Any]]
    segments: list[Segment]
    skipped_actions: dict[str, int]

    @cached_property
    def actions(self) -> Counter[str]:
        """How many rows of each action: one walk (in C) answers the several counts advice asks."""
        return Counter(map(itemgetter(0), self.rows))

    @property
    def allocations(self) -> int:
        return self.actions["alloc"]


@dataclass
class Snapshot:
    name: str
    devices: list[DeviceRecord]
    # ``allocator_settings`` as recorded; ``None`` when the snapshot has none.
    settings: Mapping[str, Any] | None

    @property
    def shows_expandable(self) -> bool:
        """Whether a segment is expandable or the history maps or unmaps pages: the sign of
        expandable segments in snapshots that record no settings."""
        return any(s.expandable for d in self.devices for s in d.segments) or any(
            d.actions["segment_map"] or d.actions["segment_unmap"] for d in self.devices
        )


def _frames(value: Any) -> Sequence[Any]:
    """Recorded stack frames: a list of them, or none when anything else is recorded there."""
    return value if isinstance(value, (list, tuple)) else ()


def _blocks(segment: Mapping[str, Any], where: str) -> list[Block]:
    """The segment's blocks; old snapshots give no block addresses, which follow from the sizes."""
    raw = segment.get("blocks", [])
    if not isinstance(raw, list):
        raise ValueError(f"{where}: 'blocks' must be a list")
    blocks, address = [], _trace._u64(segment.get("address"), "address", where)
    for index, block in enumerate(raw):
        at = f"{where}, block {index}"
        if not isinstance(block, Mapping):
            raise ValueError(f"{at}: expected a dict, got {reprlib.repr(block)}")
        size = _trace._u64(block.get("size"), "size", at)
        address = _trace._u64(block.get("address", address), "address", at)
        requested_key, requested = _trace._requested(block, address)
        frames = block.get("frames")
        if frames is None:
            frames = _trace._newest_allocation(block, address).get("frames")
        live = _trace._is_live(block)
        requested = _trace._u64(requested, requested_key, at)
        blocks.append(Block(address, size, requested, live, _frames(frames), _trace._carries_history(block)))
        address += size
    return blocks


def _segments(snapshot: Mapping[str, Any], name: str) -> dict[int, list[Segment]]:
    raw = snapshot.get("segments", [])
    if not isinstance(raw, list):
        raise ValueError(f"{name}: 'segments' must be a list")
    by_device: dict[int, list[Segment]] = {}
    for index, segment in enumerate(raw):
        where = f"{name}, segment {index}"
        if not isinstance(segment, Mapping):
            raise ValueError(f"{where}: expected a dict, got {reprlib.repr(segment)}")
        device = _trace._u64(segment.get("device", 0), "device", where)
        size = _trace._u64(segment.get("total_size"), "total_size", where)
        kind = segment.get("segment_type")
        small = kind == "small" if kind in ("small", "large") else size <= SMALL_SEGMENT
        stream = _trace._u64(segment.get("stream", 0), "stream", where)
        pool_id = segment.get("segment_pool_id")
        parsed = Segment(
            _trace._u64(segment.get("address"), "address", where),
            size,
            small,
            stream,
            bool(segment.get("is_expandable", False)),
            _blocks(segment, where),
            private=isinstance(pool_id, (tuple, list)) and any(pool_id),
        )
        by_device.setdefault(device, []).append(parsed)
    return by_device


def _device_rows(entries: list[Any], where: str) -> tuple[list[Row], dict[int, Sequence[Any]], dict[str, int]]:
    rows: list[Row] = []
    frames: dict[int, Sequence[Any]] = {}
    skipped: dict[str, int] = {}
    entry_row, fast_row = _trace._entry_row, _trace._fast_row
    for index, entry in enumerate(entries):
        # `type() is dict` first: the check of an abstract Mapping costs as much as the rest.
        action = entry.get("action") if type(entry) is dict or isinstance(entry, Mapping) else None
        # A block is reusable when its free completes; the request to free it changes nothing.
        if action == "free_requested":
            continue
        row = fast_row(entry)
        if row is None:
            if isinstance(action, str) and action not in KNOWN_ACTIONS:
                skipped[action] = skipped.get(action, 0) + 1
                continue
            row = entry_row(entry, f"{where}, entry {index}")
        if action == "alloc":
            stack = _frames(entry.get("frames"))
            if stack:
                frames[len(rows)] = stack
        rows.append(row)
    return rows, frames, skipped


def from_dict(snapshot: Any, name: str) -> Snapshot:
    """Every device of a snapshot dict with a history or segments."""
    with _trace._no_cycle_collection():
        return _from_dict(snapshot, name)


def _from_dict(snapshot: Any, name: str) -> Snapshot:
    snapshot = _trace._with_traces(snapshot)
    traces = snapshot.get("device_traces") if isinstance(snapshot, Mapping) else None
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise ValueError(
            f"{name}: not a PyTorch memory snapshot (no 'device_traces' list of lists, nor a 'segments' list)"
        )
    segments = _segments(snapshot, name)
    devices = []
    # The devices `gpupool.trace.load_each` reads: beside a recorded device, one that holds only
    # cached segments has nothing to replay.
    for device in _trace._devices(snapshot, name)[1]:
        entries = traces[device] if device < len(traces) else []
        rows, frames, skipped = _device_rows(entries, f"{name}, device_traces[{device}]")
        devices.append(DeviceRecord(device, rows, frames, segments.get(device, []), skipped))
    settings = snapshot.get("allocator_settings")
    return Snapshot(name, devices, settings if isinstance(settings, Mapping) else None)


def read(path: str | os.PathLike[str]) -> Snapshot:
    """Reads a snapshot pickle (plain or gzip) through the restricted unpickler."""
    name = os.fspath(path)
    return from_dict(_trace._read_pickle(path), name)
