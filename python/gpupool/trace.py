"""Allocation traces: load RMM logging CSVs and PyTorch memory snapshots, replay them on a pool."""

from __future__ import annotations

import contextlib
import gc
import gzip
import operator
import os
import reprlib
import warnings
import zlib
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, Union

from gpupool import _native
from gpupool._native import ReplayResult

__all__ = ["Event", "ReplayResult", "Trace", "from_snapshot", "load", "load_each", "replay"]

PathLike = Union[str, "os.PathLike[str]"]
_PICKLE_PROTOCOL_2_OR_LATER = 0x80
_GZIP_MAGIC = b"\x1f\x8b"
# Events are fetched from the native trace in chunks, so iterating costs no full copy.
_CHUNK = 65536
# Snapshot block states of memory a user holds (pending: freed, waiting for other streams).
# PyTorch writes "active_pending_free"; the Snapshot type its `_snapshot` docstring gives
# names the same state "active_awaiting_free", and hand-made snapshots follow the docs.
LIVE_STATES = frozenset(("active_allocated", "active_pending_free", "active_awaiting_free"))
# Actions PyTorch records in ``device_traces``. Anything else (a newer PyTorch's, a vendor's
# such as torch_npu's) is skipped with a warning by `load` and counted in a note by `advise`, so
# that an unknown kind of entry does not stop the replay.
KNOWN_ACTIONS = frozenset(
    (
        "alloc",
        "free_requested",
        "free_completed",
        "segment_alloc",
        "segment_free",
        "segment_map",
        "segment_unmap",
        "snapshot",
        "oom",
    )
)


class Event(NamedTuple):
    """One trace event: ``action`` is ``alloc``, ``free``, ``oom`` (a recorded failure), or what
    the job did to its pool: ``empty_cache`` (a call of ``torch.cuda.empty_cache()``) or
    ``oom_release`` (PyTorch's out-of-memory path releasing its cache before a retry). A
    release's ``size`` is the bytes the recorded allocator gave back."""

    action: str
    address: int
    size: int
    stream: int
    time_us: float


class Trace:
    """A loaded trace: events in order, every free paired with its allocation."""

    __slots__ = ("_native",)

    def __init__(self, native: _native.Trace) -> None:
        self._native = native

    @property
    def name(self) -> str:
        """Where the trace came from (a file name, for loaded traces)."""
        return self._native.name

    @property
    def streams(self) -> list[int]:
        """The traced program's stream handles, in order of first use."""
        return self._native.streams

    @property
    def peak_live_bytes(self) -> int:
        """The most bytes live at once, as requested: what any allocator must hold at least."""
        return self._native.peak_live_bytes

    @property
    def allocations(self) -> int:
        """How many allocations the trace makes (failed ones excluded)."""
        return self._native.allocations

    @property
    def capacity(self) -> int | None:
        """The most bytes the job could hold on its GPU, inferred from the snapshot's ``oom``
        entries (each records the device's free bytes beside what the job had reserved);
        ``None`` without any. Other processes and the CUDA context take the rest of the GPU."""
        return self._native.capacity

    def __len__(self) -> int:
        return len(self._native)

    def __iter__(self) -> Iterator[Event]:
        for start in range(0, len(self), _CHUNK):
            yield from map(Event._make, self._native.events(start, start + _CHUNK))

    def __repr__(self) -> str:
        return (
            f"Trace({self.name!r}, events={len(self)}, streams={len(self.streams)}, "
            f"peak_live_bytes={self.peak_live_bytes})"
        )


def _is_pickle(path: PathLike) -> bool:
    with open(path, "rb") as file:
        head = file.read(2)
    if head == _GZIP_MAGIC:
        try:
            with gzip.open(path, "rb") as file:
                head = file.read(1)
        except (OSError, EOFError, zlib.error):
            return False  # the CSV reader reports the corrupt file, naming its line
    return head[:1] == bytes([_PICKLE_PROTOCOL_2_OR_LATER])


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Pauses the cyclic garbage collector. A snapshot unpickles into millions of dicts and
    lists, and each collection would walk them all again (13 s instead of 3 for a million
    events); plain data holds no reference cycles to collect."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _decompressed_limit() -> int:
    """The most a compressed snapshot may expand to: a quarter of the machine's memory, so that
    a gzip bomb is refused instead of exhausting it (a million-event snapshot is about 200 MB)."""
    try:
        return max(1 << 30, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4)
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def _read_gzip(path: PathLike, limit: int) -> bytes:
    chunks, total = [], 0
    with gzip.open(path, "rb") as file:
        while chunk := file.read(64 << 20):
            total += len(chunk)
            if total > limit:
                raise ValueError(f"it decompresses to more than {limit >> 20} MiB")
            chunks.append(chunk)
    return b"".join(chunks)


def _read_pickle(path: PathLike) -> Any:
    with open(path, "rb") as raw:
        compressed = raw.read(2) == _GZIP_MAGIC
    try:
        if compressed:
            data = _read_gzip(path, _decompressed_limit())
        else:
            with open(path, "rb") as file:
                data = file.read()
        # The native reader builds plain data only and checks every length and memo index
        # against the bytes it has, so a damaged or hostile file fails at once instead of
        # running code or making the reader allocate gigabytes.
        with _no_cycle_collection():
            return _native.load_pickle(data)
    # A damaged pickle is a ValueError naming the opcode and byte at fault; a damaged gzip
    # stream is an OSError, EOFError or zlib.error. To the caller they all mean the same.
    except (ValueError, OSError, EOFError, zlib.error) as error:
        message = f"{os.fspath(path)}: not a readable PyTorch memory snapshot: {error}"
        raise ValueError(message) from None


def load(path: PathLike, device: int | None = None) -> Trace:
    """Reads a trace file: an RMM logging CSV (plain or gzip) or a PyTorch memory snapshot
    pickle (``torch.cuda.memory._dump_snapshot``), told apart by their first bytes.

    ``device`` picks a snapshot's device; by default the one device with trace entries or live
    blocks in its segments (with no entries anywhere, the one holding segments).
    Malformed input raises ``ValueError`` naming the file and the line or entry.
    """
    path = os.fspath(path)  # an int would be opened as a file descriptor, and closed
    device = _device_index(device)
    if _is_pickle(path):
        return _from_snapshot(_read_pickle(path), device, path)
    if device not in (None, 0):
        raise ValueError(f"{path}: an RMM CSV holds one device's allocations; there is no device {device}")
    return Trace(_native.Trace.read_csv(path))


def load_each(path: PathLike) -> list[Trace]:
    """Like ``load``, but a snapshot of several devices gives one trace per device with trace
    entries or live blocks (a job on several GPUs records them all in one file), or where
    recording was off, per device holding segments; in device order."""
    path = os.fspath(path)
    if not _is_pickle(path):
        return [Trace(_native.Trace.read_csv(path))]
    snapshot = _with_traces(_read_pickle(path))
    devices = _devices(snapshot, path)[1] if isinstance(snapshot, Mapping) else []
    # A loop, not a comprehension: before Python 3.12 a comprehension is a frame of its own,
    # and the warnings would point at it instead of at the caller.
    traces = []
    for device in devices or [None]:
        traces.append(_from_snapshot(snapshot, device, path))
    return traces


def _devices(snapshot: Mapping[str, Any], name: str = "snapshot") -> tuple[str, list[int]]:
    """The devices a snapshot has data for and what that is: those with trace entries and those
    whose segments hold live blocks (a GPU the job allocated on only before recording began),
    or where recording was off (no device has entries), those holding segments."""
    traces = snapshot.get("device_traces")
    recorded = {i for i, t in enumerate(traces) if t} if isinstance(traces, list) else set()
    segments = _device_segments(snapshot, name)
    if not recorded:
        return "segments", sorted({d for d, _ in segments})
    live = {d for d, s in segments if _holds_live_block(s)} - recorded
    return ("traces or live blocks" if live else "traces"), sorted(recorded | live)


def _device_segments(snapshot: Mapping[str, Any], name: str) -> list[tuple[int, Mapping[str, Any]]]:
    """``(device, segment)`` of every segment, read as ``gpupool advise`` reads them: a segment
    that is not a dict, or whose ``device`` is not a non-negative int, is a ValueError naming it
    (skipped, its live blocks would vanish from the replay)."""
    segments = snapshot.get("segments")
    found = []
    for index, segment in enumerate(segments if isinstance(segments, list) else []):
        where = f"{name}, segment {index}"
        if not isinstance(segment, Mapping):
            raise ValueError(f"{where}: expected a dict, got {reprlib.repr(segment)}")
        found.append((_u64(segment.get("device", 0), "device", where), segment))
    return found


def _holds_live_block(segment: Mapping[str, Any]) -> bool:
    blocks = segment.get("blocks")
    return isinstance(blocks, list) and any(isinstance(b, Mapping) and _is_live(b) for b in blocks)


def _is_live(block: Mapping[str, Any]) -> bool:
    """Whether a block's ``state`` is one of PyTorch's live states; a damaged file may hold any
    value there, an unhashable one too."""
    state = block.get("state")
    return isinstance(state, str) and state in LIVE_STATES


Row = tuple[str, int, int, int, float]


# Addresses, sizes and streams are unsigned 64-bit natively; times (in microseconds) are held to
# the same magnitude, which also keeps out inf and nan.
U64 = 1 << 64


def _u64(value: Any, key: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < U64:
        raise ValueError(f"{where}: '{key}' must be a non-negative int below 2**64, got {reprlib.repr(value)}")
    return value


# Actions whose entries are read as they stand: `snapshot` and `oom` are read otherwise.
_PLAIN_ACTIONS = KNOWN_ACTIONS - {"snapshot", "oom"}


def _fast_row(entry: Any) -> Row | None:
    """``_entry_row`` of a well-formed plain dict entry of a plain action, checked inline (a
    million of them take a second this way, and several through ``_entry_row``); ``None`` sends
    anything else to the full check, which names what is wrong."""
    if type(entry) is not dict:
        return None
    action, addr, size = entry.get("action"), entry.get("addr"), entry.get("size")
    stream, time_us = entry.get("stream", 0), entry.get("time_us", 0)
    # `type(action) is str` first: an unhashable action would make the set lookup raise.
    if type(action) is str and action in _PLAIN_ACTIONS and type(addr) is int and type(size) is int:
        if type(stream) is int and 0 <= addr < U64 and 0 <= size < U64 and 0 <= stream < U64:
            if (type(time_us) is int or type(time_us) is float) and -U64 < time_us < U64:
                return (action, addr, size, stream, float(time_us))
    return None


def _entry_row(entry: Any, where: str) -> Row:
    """``(action, addr, size, stream, time_us)`` of one ``device_traces`` entry. Errors show
    values by ``reprlib.repr``, which stops a few levels down: the plain repr of a list nested
    100,000 deep raises RecursionError."""
    if not isinstance(entry, Mapping) or not isinstance(entry.get("action"), str):
        raise ValueError(f"{where}: expected a dict with an 'action', got {reprlib.repr(entry)}")
    action = entry["action"]
    time_us = entry.get("time_us", 0)
    if not isinstance(time_us, (int, float)) or isinstance(time_us, bool) or not -U64 < time_us < U64:
        raise ValueError(f"{where}: 'time_us' must be a finite number below 2**64, got {reprlib.repr(time_us)}")
    if action == "snapshot":
        return (action, 0, 0, 0, float(time_us))
    # An `oom` entry holds the device's free bytes where others hold the block's address.
    address_key = "device_free" if action == "oom" else "addr"
    address = _u64(entry.get(address_key), address_key, where)
    size, stream = _u64(entry.get("size"), "size", where), _u64(entry.get("stream", 0), "stream", where)
    return (action, address, size, stream, float(time_us))


def _newest_allocation(block: Mapping[str, Any], address: Any) -> Mapping[str, Any]:
    """PyTorch 2.0's blocks carry no ``frames`` (nor, in 2.0.0, ``requested_size``): a
    ``history`` of the allocations made in the block holds them, newest first. The newest is
    the block's own allocation when it starts at the block; older ones lie further on, in the
    part a request did not split off. Empty when the block has no such history."""
    history = block.get("history")
    newest = history[0] if isinstance(history, list) and history else None
    return newest if isinstance(newest, Mapping) and newest.get("addr") == address else {}


def _carries_history(block: Mapping[str, Any]) -> bool:
    """Whether a block lists the allocations last made in it, as PyTorch 1.13 and 2.0 do while
    stacks are recorded (1.13 records nothing else, 2.0 keeps one trace entry by default):
    addresses, requested sizes and stack frames, newest first, with no time, stream or free, and
    those a later allocation overlapped dropped. That says what a block held, not when, so no
    replay can be built from it."""
    history = block.get("history")
    return isinstance(history, list) and bool(history)


def _requested(block: Mapping[str, Any], address: Any) -> tuple[str, Any]:
    """A live block's requested bytes and the key they are read from: ``requested_size``, else
    the ``real_size`` of its allocation in the history (PyTorch 2.0.0), else the rounded
    ``size``. A ``requested_size`` of 0 says nothing: PyTorch makes no block for 0 bytes."""
    if block.get("requested_size", 0) != 0:
        return "requested_size", block["requested_size"]
    newest = _newest_allocation(block, address)
    if "real_size" in newest:
        return "real_size", newest["real_size"]
    return "size", block.get("size")


def _live_before(
    rows: list[Row], segments: list[tuple[int, Mapping[str, Any]]], name: str
) -> list[tuple[int, int, int]]:
    """Blocks allocated before recording began, as ``(addr, size, stream)``: those whose first
    entry is a free (PyTorch's viewer draws them the same way), and those the snapshot's
    segments (with their indices) show allocated that the trace never touches. Older snapshots
    give no block addresses: a block starts where the one before it in its segment ends."""
    seen: set[int] = set()
    before: list[tuple[int, int, int]] = []
    for action, address, size, stream, _ in rows:
        if action == "free_completed" and address not in seen:
            before.append((address, size, stream))
        if action in ("alloc", "free_completed"):
            seen.add(address)
    # A block the trace never touches was allocated before it and is still live. A block that
    # cannot be placed or sized is an error, as in `gpupool advise`: skipped, a live tensor
    # would vanish from the replay.
    for index, segment in segments:
        at = f"{name}, segment {index}"
        blocks = segment.get("blocks", [])
        if not isinstance(blocks, list):
            raise ValueError(f"{at}: 'blocks' must be a list, got {reprlib.repr(blocks)}")
        follows = segment.get("address")
        for number, block in enumerate(blocks):
            block_at = f"{at}, block {number}"
            if not isinstance(block, Mapping):
                raise ValueError(f"{block_at}: expected a dict, got {reprlib.repr(block)}")
            address = _u64(block.get("address", follows), "address", block_at)
            follows = address + _u64(block.get("size"), "size", block_at)
            if _is_live(block) and address not in seen:
                size_key, size = _requested(block, address)
                before.append((address, _u64(size, size_key, block_at), _u64(segment.get("stream", 0), "stream", at)))
    return before


def _device_index(device: Any) -> int | None:
    """``device`` as an int (NumPy integers too), or None; anything else is a TypeError."""
    if device is None:
        return None
    try:
        if isinstance(device, bool):
            raise TypeError
        return operator.index(device)
    except TypeError:
        raise TypeError(f"device must be an int, got {reprlib.repr(device)}") from None


def _with_traces(snapshot: Any) -> Any:
    """``snapshot`` with an empty ``device_traces`` where it has segments only: the list that
    ``torch.cuda.memory_snapshot()`` returns, or a dict of just ``segments``. Anything else is
    returned as it is."""
    # Segments have blocks: a list of trace entries (``device_traces[0]`` alone) is no snapshot.
    if isinstance(snapshot, list) and all(isinstance(s, Mapping) and "blocks" in s for s in snapshot):
        return {"segments": snapshot, "device_traces": []}
    segments_only = isinstance(snapshot, Mapping) and snapshot.get("device_traces") is None
    if segments_only and isinstance(snapshot.get("segments"), list):
        return {**snapshot, "device_traces": []}
    return snapshot


def from_snapshot(snapshot: Any, device: int | None = None, name: str = "snapshot") -> Trace:
    """A trace from a PyTorch snapshot dict (or ``Pool.snapshot()``): its ``alloc`` and
    ``free_completed`` entries, ``oom`` entries as recorded failures, and the blocks allocated
    before recording began as allocations at the start. Segments alone (the list
    ``torch.cuda.memory_snapshot()`` returns) give their live blocks."""
    return _from_snapshot(snapshot, device, name)


def _from_snapshot(snapshot: Any, device: Any, name: str) -> Trace:
    """``from_snapshot``. Called straight from each public reader, so that a warning three frames
    up from here names the line of user code that called that reader."""
    snapshot, device = _with_traces(snapshot), _device_index(device)
    traces = snapshot.get("device_traces") if isinstance(snapshot, Mapping) else None
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise ValueError(f"{name}: not a memory snapshot (no 'device_traces' list of lists, nor a 'segments' list)")
    if device is None:
        what, devices = _devices(snapshot, name)
        if len(devices) > 1:
            raise ValueError(f"{name}: devices {devices} have {what}; pick one with device=N")
        device = devices[0] if devices else 0
    segments = [(index, s) for index, (d, s) in enumerate(_device_segments(snapshot, name)) if d == device]
    # A device past the traces' list is one whose segments are all there is of it.
    if device < 0 or (device >= max(len(traces), 1) and not segments):
        raise ValueError(f"{name}: no device {device} (the snapshot has {len(traces)})")
    entries = traces[device] if device < len(traces) else []
    where = f"{name}, device_traces[{device}]"
    rows, skipped = [], {}
    for index, entry in enumerate(entries):
        row = _fast_row(entry)
        if row is None:
            action = entry.get("action") if isinstance(entry, Mapping) else None
            if isinstance(action, str) and action not in KNOWN_ACTIONS:
                # A no-op in its place, so that errors still give entries' own indices.
                skipped[action] = skipped.get(action, 0) + 1
                row = ("snapshot", 0, 0, 0, rows[-1][4] if rows else 0.0)
            else:
                row = _entry_row(entry, f"{where}, entry {index}")
        rows.append(row)
    for action, count in sorted(skipped.items()):
        warnings.warn(f"{where}: skipped {count} '{action}' entries this version does not know", stacklevel=3)
    final_reserved = sum(_u64(s.get("total_size"), "total_size", f"{name}, segment {i}") for i, s in segments)
    native = _native.Trace.from_snapshot_entries(where, rows, _live_before(rows, segments, name), final_reserved)
    # Only where no allocation was recorded: otherwise the entries tell what the histories do.
    recorded = any(row[0] == "alloc" for row in rows)
    histories = 0 if recorded else sum(_carries_history(b) for _, s in segments for b in s.get("blocks", []))
    if histories:
        warnings.warn(
            f"{name}: device {device} records no allocations, only the {native.allocations} blocks live before "
            f"recording or at the snapshot; the 'history' in {histories} of its blocks (PyTorch 1.13's and 2.0's "
            "record) names the allocations last made in each, not when they were made or freed, and is not replayed",
            stacklevel=3,
        )
    return Trace(native)


def replay(
    trace: Trace | PathLike,
    config: str | None = None,
    capacity: int | str | None = None,
    min_capacity: bool = False,
    device: str = "sim",
    honour_job: bool = True,
) -> ReplayResult:
    """Replays ``trace`` (a ``Trace`` or a file to load) on a fresh pool with ``config``
    (PyTorch's ``key:value,...`` string) over ``device`` (``sim``, unlimited unless ``capacity``
    is given, or ``host``). Allocations that do not fit are counted in ``ooms`` and skipped.
    With ``min_capacity``, also searches for the smallest ``sim`` capacity without an OOM, to
    within 0.02% (``min_capacity_bytes`` is ``None`` if it finds none up to about 7,500 times
    the unlimited peak reserved, or if every allocation fails even on an unlimited device).

    By default the replay repeats what the job did to its pool: ``empty_cache()`` where the
    job called it, and each request that failed when recorded, tried again (and freed at
    once if it is served: the job went on without it). The out-of-memory path's releases
    are left to the replayed pool's own. ``honour_job=False`` replays the requests alone."""
    if not isinstance(trace, Trace):
        trace = load(trace)
    job = "honour" if honour_job else "ignore"
    return _native.replay(trace._native, config, capacity, min_capacity, device, job=job)
