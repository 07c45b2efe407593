"""A misuse state machine: random programs of everything a Python user can do to a pool, right
or wrong, checked against a shadow model after every step.

``tests/test_misuse.py`` (and ``make fuzz``) run it in a child interpreter, so that a crash is a
test failure rather than the end of the run; by hand:

    GPUPOOL_MISUSE=host,default,40,40,misuse.log python -m pytest tests/misuse_machine.py --hypothesis-seed=7

(device, strategy, examples, steps per example, step log). The ``cuda`` device runs on the fake
driver (tests/fake_cuda, found through LD_LIBRARY_PATH): there a held stream runs a kernel, on
scratch memory or over a live allocation, every new block is first touched by a kernel on its
stream, streams made through the driver are imported and later destroyed by their owner, graph
captures begin and end on the pool's and imported streams (at times beside another framework's
capture, which consumes a DLPack export), and any breach of the driver's rules
the fake counts (or an invalidated capture) fails the run. Each step is appended to the log
before it runs (the log restarts with each example), so after a crash it holds the steps that
led there. Failures are not shrunk unless ``GPUPOOL_MISUSE_SHRINK=1`` is set (shrinking a stateful
failure can take Hypothesis five minutes); a child that hangs has its threads' stacks dumped
(see tests/test_misuse.py).
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import itertools
import os
import shutil
import signal
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import gpupool
from pool_checks import Ledger, MiB, check_pool, rounded, rules_of

CAPACITY = {"host": 192 * MiB, "sim": 512 * MiB, "cuda": 192 * MiB}
# Mostly small requests; some large ones fill the device; some sizes are wrong on purpose.
GOOD_SIZES = st.one_of(st.integers(1, 4096), st.integers(1, 2 * MiB), st.integers(1, 40 * MiB), st.just(0))
BAD_SIZES = st.one_of(
    st.integers(-(2**70), -1),
    st.integers(2**62 + 1, 2**80),
    st.integers(600 * MiB, 2**62),
    st.floats(allow_nan=True),
    st.sampled_from(["1MiB", None, b"\x00", 3.0, [1], object()]),
)
# A history this long keeps every event of a program (each step makes a few hundred at most).
WHOLE = 10**6
DTYPES = ("uint8", "int16", "float32", "float64", "complex64", "bool")
LOG: Path | None = None
STACKS = None  # kept open for faulthandler


def pick(data, items: list):
    """One of ``items``, drawn by index: Hypothesis then keeps no reference to the item itself
    (a kept DevicePtr or array would keep memory alive that a step meant to release)."""
    return items[data.draw(st.integers(0, len(items) - 1))]


def log(line: str) -> None:
    if LOG is not None:
        with LOG.open("a") as f:
            f.write(line + "\n")


@dataclass(eq=False)
class Entry:
    """One allocation the program made, live or freed-and-held, with what its owner wrote."""

    ptr: gpupool.DevicePtr
    address: int
    size: int
    block: int
    stream: int
    uses: set[int] = field(default_factory=set)
    freed: bool = False
    # The newest writes as (offset, bytes), oldest first; older ones are dropped unverified.
    writes: list[tuple[int, bytes]] = field(default_factory=list)

    # Kernels queued on it and not yet run, as (stream, start, end).
    kernels: list[tuple[int, int, int]] = field(default_factory=list)

    def write(self, offset: int, data: bytes) -> None:
        if data:
            self.writes = [*self.writes[-15:], (offset, bytes(data))]

    def forget(self, start: int, end: int) -> None:
        """Drops what is remembered of the bytes in ``[start, end)``."""
        kept = []
        for offset, data in self.writes:
            before, after = data[: max(0, start - offset)], data[max(0, end - offset) :]
            kept += [(offset, before)] if before else []
            kept += [(offset + len(data) - len(after), after)] if after else []
        self.writes = kept

    def racing(self, start: int, end: int, stream: int) -> set[int]:
        """The streams other than ``stream`` with a queued kernel on ``[start, end)``: work there
        on ``stream`` would race with them."""
        return {k for k, s, e in self.kernels if k != stream and s < end and start < e}

    def expected(self) -> list[tuple[int, bytes]]:
        """What each remembered write's range must hold now: the write, overlaid by later ones."""
        out = []
        for i, (offset, data) in enumerate(self.writes):
            now = bytearray(data)
            for later, more in self.writes[i + 1 :]:
                lo, hi = max(offset, later), min(offset + len(data), later + len(more))
                if lo < hi:
                    now[lo - offset : hi - offset] = more[lo - later : hi - later]
            out.append((offset, bytes(now)))
        return out


@dataclass(eq=False)
class Export:
    """An export of an entry's bytes (array, view, capsule); ``array`` is a writable uint8 view."""

    entry: Entry
    holder: object
    array: np.ndarray | None


@dataclass(eq=False)
class Pending:
    """A freed block still active until the streams in ``waits`` finish their work (and, while
    ``CAPTURE`` is among them, until the capture that uses it ends); after that the pool frees
    it at its next poll (of which the model does not know the timing). ``streams`` are its
    owner and the streams it was used on."""

    address: int
    block: int
    waits: set[int]
    streams: set[int]


# In a pending block's waits: a capture that uses the block is underway.
CAPTURE = -1


@dataclass(eq=False)
class Capture:
    """A stream being captured into a CUDA graph, begun by the program through the driver."""

    sid: int
    stream: gpupool.Stream


class FakeDriver:
    """The fake CUDA driver's test controls: kernels that keep a stream busy over a range of
    device memory until a synchronizing call (or ``complete``) runs them, and the count of
    driver-rule breaches."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.fake_cuda_violations.restype = ctypes.c_ulonglong
        lib.fake_cuda_last_violation.restype = ctypes.c_char_p
        lib.fake_cuda_launch.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_ubyte]
        lib.fake_cuda_complete.argtypes = [ctypes.c_void_p]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        lib.cuStreamDestroy_v2.argtypes = [ctypes.c_void_p]
        lib.cuStreamBeginCapture_v2.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.cuStreamEndCapture.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cuStreamIsCapturing.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.fake_cuda_used.restype = ctypes.c_ulonglong
        lib.fake_cuda_mappings.restype = ctypes.c_ulonglong
        self.lib = lib
        assert gpupool.device_count() > 0  # initializes the driver
        # Scratch memory outside the pool, for kernels that only keep a stream busy.
        device, context, scratch = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
        assert lib.cuDeviceGet(ctypes.byref(device), 0) == 0
        assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
        assert lib.cuCtxSetCurrent(context) == 0
        assert lib.cuMemAlloc_v2(ctypes.byref(scratch), SCRATCH_SLOTS * 4096) == 0
        self.scratch = scratch.value
        self.seen = 0  # violations before the current program: a failing one is replayed
        self.used = 0  # device memory in use before it (the scratch memory)

    def begin(self) -> None:
        self.seen = self.lib.fake_cuda_violations()
        self.used = self.lib.fake_cuda_used(0)

    def create_stream(self) -> int:
        """A stream made by another framework, straight through the driver (non-blocking, as
        PyTorch's and CuPy's side streams are)."""
        handle = ctypes.c_void_p()
        assert self.lib.cuStreamCreate(ctypes.byref(handle), 1) == 0
        return handle.value

    def destroy_stream(self, handle: int) -> None:
        assert self.lib.cuStreamDestroy_v2(handle) == 0

    def begin_capture(self, handle: int, mode: int) -> None:
        assert self.lib.cuStreamBeginCapture_v2(handle, mode) == 0

    def end_capture(self, handle: int) -> int:
        graph = ctypes.c_void_p()
        return self.lib.cuStreamEndCapture(handle, ctypes.byref(graph))

    def capture_status(self, handle: int) -> int:
        """0 none, 1 active, 2 invalidated."""
        status = ctypes.c_int()
        assert self.lib.cuStreamIsCapturing(handle, ctypes.byref(status)) == 0
        return status.value

    def launch(self, stream: gpupool.Stream, address: int, size: int, tag: int) -> None:
        assert self.lib.fake_cuda_launch(stream.handle, address, size, tag) == 0

    def complete(self, stream: gpupool.Stream) -> None:
        assert self.lib.fake_cuda_complete(stream.handle) == 0

    def check(self) -> None:
        count = self.lib.fake_cuda_violations() - self.seen
        assert count == 0, f"{count} driver-rule violations, the last: {self.lib.fake_cuda_last_violation().decode()}"

    def check_released(self) -> None:
        """After a pool closed: all its device memory went back to the driver."""
        assert self.lib.fake_cuda_used(0) == self.used, "the pool's device memory leaked at close"
        assert self.lib.fake_cuda_mappings() == 0, "mapped pages outlived the pool"


FAKE: FakeDriver | None = None
# Scratch pages, one per stream that holds one: kernels of two streams on the same bytes would
# race (the fake rightly counts that), and at most six streams (the pool's, imported, or imported
# and forgotten by the pool but not destroyed by their owner yet) exist at once.
SCRATCH_SLOTS = 8
STREAMS = 6


class MisuseMachine(RuleBasedStateMachine):
    device = "host"
    strategy = "default"

    def __init__(self) -> None:
        super().__init__()
        if LOG is not None:
            LOG.write_text(f"# {self.device} strategy:{self.strategy}\n")
        self.host = self.device == "host"  # bytes the host can reach: arrays, buffers
        self.cuda = self.device == "cuda"
        self.copies = self.host or self.cuda
        global FAKE
        if self.cuda and FAKE is None:
            FAKE = FakeDriver()
        if self.cuda:
            FAKE.begin()  # before the pool opens: some strategies allocate then
        self.pool = gpupool.Pool(self.device, capacity=CAPACITY[self.device], config=f"strategy:{self.strategy}")
        self.other_pool = gpupool.Pool("sim", capacity=64 * MiB)
        self.slots: dict[int, int] = {}  # scratch slot of each stream that held one
        self.entries: list[Entry] = []
        self.exports: list[Export] = []
        self.pending: list[Pending] = []
        self.streams: dict[int, gpupool.Stream] = {0: self.pool.default_stream}
        self.held: set[int] = set()
        # Streams whose work a pool-wide wait during a capture may or may not have waited for
        # (imported ones the pool may hold nothing for): a query tells.
        self.unsure: set[int] = set()
        # Streams imported from "another framework" (made through the driver), by id: handle.
        self.imported: dict[int, int] = {}
        # Imported streams a pointer was ever made or recorded on: the pool may hold blocks for
        # them, and pointers order exports there.
        self.touched: set[int] = set()
        # Imported streams the pool forgot but their owner has not destroyed: handle -> the
        # scratch slot its queued kernel may still use.
        self.orphans: dict[int, int | None] = {}
        self.capture: Capture | None = None
        self.dead_streams: list[gpupool.Stream] = []
        # Streams the program dropped while a pointer still held them (see destroy_stream).
        self.kept_by_pointers: list[gpupool.Stream] = []
        # Freed entries the program still holds, for double frees: their bytes back in the pool,
        # their pointers no longer keep their streams alive (README).
        self.freed: list[Entry] = []
        self.ledger = Ledger()
        self.tags = itertools.count(1)
        self.synchronizations = (0, 0)
        self.recording = 0  # the history's max_entries while one is recorded
        self.recorded_from = 0  # the ledger's allocations when it started
        self.whole = False
        self.scratch = Path(tempfile.mkdtemp(prefix="gpupool-misuse-"))

    # ----- the model ---------------------------------------------------------------------------

    def live(self) -> list[Entry]:
        return [e for e in self.entries if not e.freed]

    def exports_of(self, entry: Entry) -> list[Export]:
        return [x for x in self.exports if x.entry is entry]

    def all_idle(self) -> None:
        """Every stream finished its work (a device synchronize happened). During a capture the
        pool waits instead for each stream it watches but the capturing one (README, CUDA),
        and perhaps for the events its pending frees recorded on that one before the capture
        (which is allowed): those frees and that stream's work may or may not be done."""
        if self.capture is None:
            self.held.clear()
            self.unsure.clear()
            for p in self.pending:
                p.waits.clear()
            for e in self.entries:
                e.kernels.clear()
            return
        for sid in self.held | self.unsure:
            watched = self.watched(sid) and not self.capturing(sid)
            if watched:
                self.stream_idle(sid)
            elif watched is None or self.capturing(sid):
                self.held.discard(sid)
                self.unsure.add(sid)
        for p in self.pending:
            p.waits.discard(self.capture.sid)

    def stream_idle(self, stream: int) -> None:
        self.held.discard(stream)
        self.unsure.discard(stream)
        for p in self.pending:
            p.waits.discard(stream)
        for e in self.entries:
            e.kernels = [k for k in e.kernels if k[0] != stream]

    def capturing(self, sid: int | None) -> bool:
        return self.capture is not None and self.capture.sid == sid

    def involved(self, sid: int) -> bool | None:
        """Whether the pool holds an allocated or pending block made or used on ``sid`` (None:
        perhaps, a freed block whose streams finished and that the pool may not have polled)."""
        if any(e.block and (e.stream == sid or sid in e.uses) for e in self.entries):
            return True
        pending = [p for p in self.pending if sid in p.streams]
        if any(p.waits for p in pending):
            return True
        return None if pending else False

    def watched(self, sid: int) -> bool | None:
        """Whether the pool waits for ``sid`` while another stream captures: the default stream,
        its own streams, and imported ones it holds any block for (owned, even free, or used);
        None where that is not known."""
        if sid not in self.imported or self.involved(sid):
            return True
        return None if sid in self.touched else False

    def copied_on(self, stream: int) -> None:
        """A copy ran on ``stream``: on cuda it waited for the stream's queued work (the host
        device copies at once, and a held stream stays held)."""
        if self.cuda:
            self.stream_idle(stream)

    def released(self, entry: Entry) -> None:
        """The last holder of a freed entry's bytes let go: it waits for busy use streams or is
        free; one whose stream or a stream it was used on captures waits for the capture's end."""
        self.entries.remove(entry)
        streams = {entry.stream} | entry.uses
        waits = entry.uses & self.held
        if self.capture is not None and self.capture.sid in streams:
            waits.add(CAPTURE)
        # One used on a stream that may still be busy may wait for it too (with no waits, a
        # pending block may go at any poll).
        if (waits or entry.uses & self.unsure) and entry.block:
            self.pending.append(Pending(entry.address, entry.block, waits, streams))
        # The pointer let go of its streams: a dropped one no other pointer holds goes now.
        for sid in [s.id for s in self.kept_by_pointers if not self.held_by_pointers(s.id)]:
            log(f"(stream {sid} goes with the last pointer that held it)")
            self.kept_by_pointers = [s for s in self.kept_by_pointers if s.id != sid]
            gc.collect()
            self.forgotten(sid)

    def observe_synchronizations(self) -> None:
        """Returning memory to the device (`cudaFree` semantics) and the out-of-memory ladder
        synchronize every stream: their counters tell when that happened."""
        stats = self.pool.memory_stats()
        # The cuda backend waits for the device only where the pool says so (a driver free does
        # not, in the fake): there only the pool's own synchronizations count.
        freed = stats["num_sync_all_streams"] if self.cuda else stats["num_device_free"]
        seen = (freed, stats["num_alloc_retries"])
        if seen != self.synchronizations:
            self.synchronizations = seen
            self.all_idle()

    def stream_choice(self, data) -> tuple[int, gpupool.Stream]:
        choices = sorted(self.streams)
        sid = pick(data, choices)
        return sid, self.streams[sid]

    # ----- allocation --------------------------------------------------------------------------

    @rule(size=st.integers(1, 4096), data=st.data())
    def alloc_small(self, size, data):
        self.alloc(size, data)

    @rule(size=GOOD_SIZES, data=st.data())
    def alloc(self, size, data):
        self.allocate(size, *self.stream_choice(data))

    def allocate(self, size: int, sid: int, stream: gpupool.Stream) -> None:
        log(f"alloc({size}, stream={sid})")
        if sid in self.imported:
            self.touched.add(sid)  # its pointer, even an empty one, orders exports there
        try:
            ptr = self.pool.alloc(size, stream=stream)
        except gpupool.OutOfMemoryError as e:
            assert str(size) in str(e)
            return
        except RuntimeError as e:
            assert self.capturing(sid) and "captured into a CUDA graph" in str(e), e
            return
        assert not (self.capturing(sid) and size), "allocated on a capturing stream"
        assert ptr.size == size and not ptr.freed and ptr.exports == 0
        block = self.block_size(ptr)
        self.ledger.allocated(size)
        self.entries.append(Entry(ptr, ptr.ptr, size, block, sid))
        if self.cuda and size:
            # The new owner's first work: a kernel over the whole block, run at once. The fake
            # counts a violation if a kernel another stream queued earlier still uses any byte.
            FAKE.launch(stream, ptr.ptr, block, 0)
            FAKE.complete(stream)
        if self.copies and size:
            # An owner's first write: a stamp at both ends.
            data_bytes = bytes([next(self.tags) % 251]) * min(size, 64)
            ptr.copy_from_host(data_bytes)
            ptr.copy_from_host(data_bytes, size - len(data_bytes))
            self.entries[-1].write(0, data_bytes)
            self.entries[-1].write(size - len(data_bytes), data_bytes)
            self.copied_on(sid)

    def block_size(self, ptr) -> int:
        if ptr.size == 0:
            return 0
        for segment in self.pool.snapshot()["segments"]:
            for b in segment["blocks"]:
                if b["address"] == ptr.ptr and b["state"] == "active_allocated":
                    return b["size"]
        raise AssertionError(f"no block at {ptr.ptr:#x}")

    def alloc_wrong(self, size):
        log(f"alloc_wrong({size!r})")
        try:
            self.pool.alloc(size)
        except (TypeError, ValueError, OverflowError, gpupool.OutOfMemoryError):
            return
        raise AssertionError(f"alloc({size!r}) succeeded")

    def alloc_on_foreign_stream(self, data):
        stream = pick(data, [self.other_pool.default_stream, *self.dead_streams])
        log("alloc_on_foreign_stream")
        try:
            self.pool.alloc(512, stream=stream)
        except ValueError:
            return
        raise AssertionError("allocated on another pool's or a destroyed stream")

    # ----- freeing -----------------------------------------------------------------------------

    @precondition(lambda self: self.live())
    @rule(data=st.data(), how=st.sampled_from(["method", "pool", "with", "drop"]))
    def free(self, data, how):
        # Often the last pointer holding a stream the program dropped, which then goes too.
        kept = {s.id for s in self.kept_by_pointers}
        holders = [e for e in self.live() if e.stream in kept or e.uses & kept]
        entry = pick(data, holders if holders and data.draw(st.booleans()) else self.live())
        exported = bool(self.exports_of(entry))
        if how == "drop" and exported:
            how = "method"  # exports keep the pointer alive: dropping our reference frees nothing
        self.free_entry(entry, how, exported)

    def free_entry(self, entry: Entry, how: str, exported: bool) -> None:
        log(f"free({entry.ptr!r}, how={how}, exported={exported})")
        ptr = entry.ptr
        if how == "method":
            ptr.free()
        elif how == "pool":
            self.pool.free(ptr)
        elif how == "with":
            with ptr:
                pass
        else:
            # Our references are the only ones: the last one going frees the block.
            entry.ptr = None  # type: ignore[assignment]
            del ptr
            gc.collect()
            self.ledger.freed(entry.size)
            self.released(entry)
            return
        assert ptr.freed
        self.ledger.freed(ptr.size)
        entry.freed = True
        self.freed = [*self.freed[-3:], entry]
        if not exported:
            self.released(entry)

    def double_free(self, data, how):
        ptr = pick(data, self.freed).ptr
        log(f"double_free({ptr!r}, how={how})")
        try:
            ptr.free() if how == "method" else self.pool.free(ptr)
        except ValueError as e:
            assert "double free" in str(e)
            return
        raise AssertionError("a double free succeeded")

    def free_through_another_pool(self, data):
        entry = pick(data, self.live())
        log(f"free_through_another_pool({entry.ptr!r})")
        try:
            self.other_pool.free(entry.ptr)
        except ValueError:
            return
        raise AssertionError("another pool freed this pointer")

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def racing_free(self, data):
        entry = pick(data, self.live())
        log(f"racing_free({entry.ptr!r})")
        outcomes: list[str] = []
        barrier = threading.Barrier(2)

        def free():
            barrier.wait()
            try:
                entry.ptr.free()
                outcomes.append("freed")
            except ValueError as e:
                outcomes.append(str(e))

        threads = [threading.Thread(target=free) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a racing free hung"
        assert outcomes.count("freed") == 1 and sum("double free" in o for o in outcomes) == 1, outcomes
        self.ledger.freed(entry.ptr.size)
        entry.freed = True
        if not self.exports_of(entry):
            self.released(entry)

    # ----- exports and copies ------------------------------------------------------------------

    @precondition(lambda self: self.entries)
    @rule(data=st.data(), kind=st.sampled_from(["asarray", "view", "from_dlpack", "capsule"]))
    def export(self, data, kind):
        self.export_entry(data, pick(data, self.entries), kind)

    def export_entry(self, data, entry: Entry, kind: str) -> None:
        ptr = entry.ptr
        log(f"export({ptr!r}, {kind})")
        before = ptr.exports
        # Ordering the consumer (the legacy stream) after a capturing producer is refused.
        crosses = kind == "capsule" and not entry.freed and self.capturing(entry.stream)
        try:
            if kind == "asarray":
                holder = np.asarray(ptr)
                array = holder
            elif kind == "view":
                dtype = data.draw(st.sampled_from(DTYPES))
                holder = ptr.view(dtype)
                array = np.asarray(holder).view(np.uint8).reshape(-1) if self.host else None
            elif kind == "from_dlpack":
                holder = np.from_dlpack(ptr)
                array = holder
            else:
                holder = ptr.__dlpack__()
                array = None
        except ValueError as e:
            assert entry.freed and "was freed" in str(e), e
            assert ptr.exports == before
            return
        except (AttributeError, BufferError, TypeError, RuntimeError) as e:
            assert not self.host, e  # sim memory has no bytes, and NumPy reads no device memory
            if kind == "capsule" and self.cuda:
                assert crosses and "captured into a CUDA graph" in str(e), e
            assert ptr.exports == before, "a failed export left its pin"
            return
        assert not crosses, "a capsule ordered the legacy stream after a capture"
        assert not entry.freed, "a freed pointer made a new export"
        assert ptr.exports == before + 1
        if array is not None and not array.flags.writeable:
            array = None
        self.exports.append(Export(entry, holder, array))

    @precondition(lambda self: self.exports)
    @rule(data=st.data())
    def drop_export(self, data):
        export = pick(data, self.exports)
        log(f"drop_export({export.entry.ptr!r})")
        self.exports.remove(export)
        export.holder = export.array = None
        gc.collect()
        if export.entry.freed and not self.exports_of(export.entry):
            self.released(export.entry)

    @precondition(lambda self: any(x.array is not None for x in self.exports))
    @rule(data=st.data(), value=st.integers(0, 255))
    def write_through_export(self, data, value):
        export = pick(data, [x for x in self.exports if x.array is not None])
        size = len(export.array)  # a view of a wide dtype may cover less than the allocation
        if size == 0:
            return
        start = data.draw(st.integers(0, size - 1))
        end = data.draw(st.integers(start + 1, min(size, start + 8192)))
        log(f"write_through_export({export.entry.ptr!r}, {start}:{end}, freed={export.entry.freed})")
        export.array[start:end] = value
        export.entry.write(start, bytes([value]) * (end - start))

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def copy_in(self, data):
        entry = pick(data, self.entries)
        size = entry.size
        offset = data.draw(st.one_of(st.integers(0, size + 16), st.integers(-(2**65), 2**65)))
        payload = bytes(data.draw(st.binary(max_size=1024)))
        if not self.wait_for_kernels(entry, offset, offset + len(payload)):
            return
        log(f"copy_in({entry.ptr!r}, offset={offset}, len={len(payload)})")
        # A copy waits for its stream, which a capture forbids.
        refused = not entry.freed and self.capturing(entry.stream)
        try:
            entry.ptr.copy_from_host(payload, offset)
        except ValueError as e:
            fits = 0 <= offset and offset + len(payload) <= size
            captured = refused and "captured into a CUDA graph" in str(e)
            assert entry.freed or not fits or (payload and not self.copies) or captured, e
            return
        except (OverflowError, TypeError):
            assert offset < 0 or offset > 2**64
            return
        assert not entry.freed and self.copies or not payload
        assert not (refused and payload), "copied into an allocation of a capturing stream"
        if payload:
            self.copied_on(entry.stream)
        entry.write(offset, payload)

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def copy_out(self, data):
        entry = pick(data, self.entries)
        size = entry.size
        offset = data.draw(st.integers(0, size + 16))
        length = data.draw(st.integers(0, size + 16))
        if not self.wait_for_kernels(entry, offset, offset + length):
            return
        log(f"copy_out({entry.ptr!r}, offset={offset}, size={length})")
        refused = not entry.freed and self.capturing(entry.stream)
        try:
            out = entry.ptr.copy_to_host(offset, length)
        except ValueError as e:
            captured = refused and "captured into a CUDA graph" in str(e)
            assert entry.freed or offset + length > size or (length and not self.copies) or captured, e
            return
        assert len(out) == length and not entry.freed
        assert not (refused and length), "copied out of an allocation of a capturing stream"
        if length:
            self.copied_on(entry.stream)
        for start, expected in entry.expected():
            lo, hi = max(start, offset), min(start + len(expected), offset + length)
            if lo < hi:
                read, wrote = out[lo - offset : hi - offset], expected[lo - start : hi - start]
                assert read == wrote, "copy_to_host read other bytes"

    # ----- streams -----------------------------------------------------------------------------

    def room_for_a_stream(self) -> bool:
        return len(self.streams) + len(self.orphans) < STREAMS

    def new_stream(self):
        stream = self.pool.stream()
        log(f"new_stream() -> {stream.id}")
        self.streams[stream.id] = stream

    def hold(self, data):
        sid, stream = self.stream_choice(data)
        if not self.cuda:
            log(f"hold({sid})")
            stream.hold()
        else:
            # A kernel that stays queued: over an allocation the stream owns or was recorded
            # on (the bytes a free must not hand out until it ran), or over scratch memory.
            users = [e for e in self.live() if e.size and (e.stream == sid or sid in e.uses)]
            if users and data.draw(st.booleans()):
                self.kernel(data, sid, stream, pick(data, users))
                return
            if sid not in self.slots:
                alive = {*self.streams, *(s.id for s in self.kept_by_pointers)}
                taken = {self.slots[s] for s in alive if s in self.slots} | set(self.orphans.values())
                self.slots[sid] = min(set(range(SCRATCH_SLOTS)) - taken)
            log(f"kernel({sid}, scratch slot {self.slots[sid]})")
            FAKE.launch(stream, FAKE.scratch + self.slots[sid] * 4096, 4096, 0)
            if self.capturing(sid):
                return  # captured into the graph: it never runs here
        self.held.add(sid)
        self.unsure.discard(sid)

    def wait_for_kernels(self, entry: Entry, start: int, end: int, stream: int | None = None) -> bool:
        """What a correct program does before it touches bytes on ``stream`` (the owner's by
        default) that another stream's queued kernel writes: it waits for that stream. A
        capturing stream cannot be waited for: then the program does not touch them (False)."""
        if entry.freed:
            return True
        racing = sorted(entry.racing(start, end, entry.stream if stream is None else stream))
        if any(self.capturing(sid) for sid in racing):
            log("(skipped: a capturing stream's kernel uses those bytes)")
            return False
        for sid in racing:
            log(f"synchronize_stream({sid})")
            self.streams[sid].synchronize()
            self.stream_idle(sid)
        return True

    def kernel(self, data, sid: int, stream: gpupool.Stream, entry: Entry) -> None:
        """Queues a kernel on ``stream`` that writes into ``entry`` once it runs."""
        start = data.draw(st.integers(0, entry.size - 1))
        end = data.draw(st.integers(start + 1, entry.size))
        tag = data.draw(st.integers(0, 255))
        if self.capturing(sid):
            log(f"kernel({sid}, {entry.ptr!r}, {start}:{end}, tag={tag}) captured")
            FAKE.launch(stream, entry.address + start, end - start, tag)
            return  # into the graph: it never runs here
        if not self.wait_for_kernels(entry, start, end, sid):
            return
        log(f"kernel({sid}, {entry.ptr!r}, {start}:{end}, tag={tag})")
        FAKE.launch(stream, entry.address + start, end - start, tag)
        if sid == entry.stream:
            entry.write(start, bytes([tag]) * (end - start))  # ordered before the owner's copies
        else:
            entry.forget(start, end)  # unknown until that stream is waited for
        entry.kernels.append((sid, start, end))
        self.held.add(sid)
        self.unsure.discard(sid)

    @precondition(lambda self: self.cuda and any(e.size for e in self.live()))
    @rule(data=st.data(), then_free=st.booleans())
    def use_on_a_stream(self, data, then_free):
        """What a framework does with a tensor on a side stream: ``record_stream``, a kernel
        there, often the free right after; the block's next owner must not overtake the kernel."""
        entry = pick(data, [e for e in self.live() if e.size])
        if len(self.streams) == 1:
            self.new_stream()  # a side stream to use it on
        self.use_on(data, entry, *self.stream_choice(data), then_free)

    def use_on(self, data, entry: Entry, sid: int, stream: gpupool.Stream, then_free: bool) -> None:
        log(f"record_stream({entry.ptr!r}, {sid})")
        entry.ptr.record_stream(stream)
        if sid != entry.stream:
            entry.uses.add(sid)
        if sid in self.imported:
            self.touched.add(sid)
        self.kernel(data, sid, stream, entry)
        if then_free:
            self.free_entry(entry, "method", bool(self.exports_of(entry)))

    def query(self, data):
        sid, stream = self.stream_choice(data)
        log(f"query({sid})")
        if self.refused_during_capture(sid, stream.query):
            return
        idle = stream.query()
        if sid in self.unsure:
            self.unsure.discard(sid)
            if idle:
                self.stream_idle(sid)
            else:
                self.held.add(sid)
            return
        assert idle == (sid not in self.held)

    def synchronize_stream(self, data):
        sid, stream = self.stream_choice(data)
        log(f"synchronize_stream({sid})")
        if self.refused_during_capture(sid, stream.synchronize):
            return
        stream.synchronize()
        self.stream_idle(sid)

    def refused_during_capture(self, sid: int, call) -> bool:
        """Whether ``sid`` captures, and ``call`` (a query, wait or destroy) was refused."""
        if not self.capturing(sid):
            return False
        try:
            call()
        except RuntimeError as e:
            assert "cannot be queried, waited for or destroyed" in str(e), e
            return True
        raise AssertionError(f"{call.__name__} of a capturing stream was not refused")

    def destroy_stream(self, data, drop):
        # The program needs a capturing stream to end its capture: it destroys it only on purpose.
        choices = [s for s in self.streams if s != 0 and not (drop and self.capturing(s))]
        if not choices:
            return
        sid = pick(data, choices)
        log(f"destroy_stream({sid}, drop={drop})")
        if not drop:
            destroy = self.streams[sid].destroy
            if self.external_destroy_refused(sid) or self.refused_during_capture(sid, destroy):
                return
        stream = self.streams.pop(sid)
        if drop:
            if self.held_by_pointers(sid):
                # A pointer keeps the streams it was made or recorded on alive until its bytes are
                # back in the pool (freed, no export left), so dropping the program's reference
                # destroys nothing yet: the stream keeps its queued work. The model keeps the
                # object too, and lets go of it when the last such pointer's bytes come back
                # (`released`): then the pool destroys or forgets it, and an imported stream's
                # owner may destroy it.
                log(f"(stream {sid} kept by its pointers)")
                self.kept_by_pointers.append(stream)
                return
            del stream
            gc.collect()
        else:
            if sid not in self.imported:
                stream.destroy()
            self.dead_streams = [*self.dead_streams[-2:], stream]
            try:
                stream.destroy()
            except ValueError:
                pass
            else:
                raise AssertionError("a stream was destroyed twice")
            # Its live and held allocations pass to the default stream, their frees and copies
            # now ordered there: a use on the default stream is the owner's own, with no wait.
            # (A dropped stream is destroyed only once no pointer holds it, so none has any.)
            for entry in self.entries:
                if entry.stream == sid:
                    entry.stream = 0
                    entry.uses.discard(0)
        self.forgotten(sid)

    def held_by_pointers(self, sid: int) -> bool:
        return any(entry.stream == sid or sid in entry.uses for entry in self.entries)

    def forgotten(self, sid: int) -> None:
        """The pool destroyed stream ``sid`` (waiting for it), or forgot an imported one."""
        if sid in self.imported:
            # Only forgotten: its owner destroys it when it likes, its queued work still running.
            self.orphans[self.imported.pop(sid)] = self.slots.pop(sid, None)
            self.touched.discard(sid)
        self.stream_idle(sid)

    def external_destroy_refused(self, sid: int) -> bool:
        """``destroy()`` of an imported stream (which is then done, if not refused): refused
        while allocations are made or used on it (README: its owner may still queue work there
        that the default stream would not see), pending frees included (the error says to let
        them complete)."""
        if sid not in self.imported:
            return False
        holds = self.involved(sid)
        try:
            self.streams[sid].destroy()
        except ValueError as e:
            assert holds is not False and "still has allocations" in str(e), e
            return True
        assert holds is not True, "an imported stream was forgotten under its allocations"
        return False

    def destroy_default_stream(self):
        log("destroy_default_stream()")
        try:
            self.pool.default_stream.destroy()
        except ValueError:
            return
        raise AssertionError("the default stream was destroyed")

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def record_stream(self, data):
        entry = pick(data, self.entries)
        sid, target = pick(data, [*self.streams.items(), *((None, s) for s in self.dead_streams)])
        log(f"record_stream({entry.ptr!r}, {sid})")
        try:
            entry.ptr.record_stream(target)
        except ValueError:
            assert entry.freed or sid is None
            return
        assert not entry.freed and sid is not None
        if sid != entry.stream and entry.ptr.size:
            entry.uses.add(sid)
        if sid in self.imported:
            self.touched.add(sid)

    def synchronize(self):
        log("synchronize()")
        self.pool.synchronize()
        self.all_idle()
        for sid, stream in self.streams.items():
            if not self.capturing(sid) and sid not in self.unsure:
                assert stream.query() == (sid not in self.held), f"stream {sid} after a synchronize"

    def empty_cache(self):
        log("empty_cache()")
        self.pool.empty_cache()
        self.all_idle()

    def summaries(self):
        log("summaries()")
        summary = self.pool.memory_summary()
        assert "Allocated memory" in summary
        self.pool.snapshot()

    def reset_peaks(self):
        log("reset_peak_memory_stats()")
        self.pool.reset_peak_memory_stats()
        stats = self.pool.memory_stats()
        for key, value in stats.items():
            if key.endswith(".peak"):
                assert value == stats[key.removesuffix("peak") + "current"], f"{key} not reset"
        assert self.pool.max_memory_allocated() == self.pool.memory_allocated()
        assert self.pool.max_memory_reserved() == self.pool.memory_reserved()

    def history(self, data, op):
        """Recording on and off, resized, and dumped: whatever the pool did meanwhile, what it
        dumps is a well-formed trace that replays without a failure and, while the record was
        never short, holds every allocation made since it started."""
        if op == "start":
            entries = data.draw(st.one_of(st.integers(0, 64), st.just(WHOLE), st.integers(-(2**65), 2**70)))
            log(f"record_history(max_entries={entries})")
            try:
                self.pool.record_history(max_entries=entries)
            except OverflowError:
                assert not 0 <= entries < 2**64
                return
            except ValueError as e:
                assert entries == 0 and "max_entries" in str(e)
                return
            if not self.recording:
                self.recorded_from = self.ledger.allocations
            # Only a record that never held fewer than WHOLE entries still has every allocation.
            self.whole = entries == WHOLE and (self.whole or not self.recording)
            self.recording = entries
        elif op == "stop":
            log("record_history(enabled=False)")
            self.pool.record_history(enabled=False)
            self.recording = 0
        else:
            path = self.scratch / "history.csv"
            log("dump_trace()")
            try:
                # Releases of cached memory are left out of RMM's CSV, with a warning.
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", ".*of cached memory left out")
                    self.pool.dump_trace(path)
            except ValueError as e:
                assert not self.recording and "record_history" in str(e)
                return
            assert self.recording, "a history was dumped while none was recorded"
            trace = gpupool.trace.load(path)
            assert trace.allocations <= self.recording
            if self.whole:
                made = self.ledger.allocations - self.recorded_from
                assert trace.allocations == made, f"{made} allocations, {trace.allocations} in the history"
            result = gpupool.replay(trace)
            assert result.ooms == 0 and result.peak_live_bytes == trace.peak_live_bytes

    # ----- threads -----------------------------------------------------------------------------

    @rule(seed=st.integers(0, 2**16), threads=st.integers(2, 4))
    def threads(self, seed, threads):
        """Threads allocate, write, export, read back and free their own blocks at once."""
        log(f"threads(seed={seed}, threads={threads})")
        errors: list[BaseException] = []
        counts: list[tuple[int, int]] = []

        def work(index: int) -> None:
            rng = np.random.default_rng(seed + index)
            made = total = 0
            try:
                for _ in range(20):
                    size = int(rng.integers(1, 256 * 1024))
                    try:
                        ptr = self.pool.alloc(size)
                    except gpupool.OutOfMemoryError:
                        continue
                    made, total = made + 1, total + size
                    stamp = bytes([index + 1]) * min(size, 32)
                    if self.host:
                        ptr.copy_from_host(stamp, size - len(stamp))
                        view = np.asarray(ptr)
                        assert bytes(view[size - len(stamp) :]) == stamp, "another thread's bytes"
                        if rng.random() < 0.5:
                            ptr.free()  # the array holds the bytes until it goes
                            del view
                            continue
                        del view
                    ptr.free()
            except BaseException as e:  # reported by the main thread
                errors.append(e)
            counts.append((made, total))

        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
            assert not w.is_alive(), "a thread hung"
        assert not errors, errors
        for made, total in counts:
            self.ledger.allocations += made
            self.ledger.frees += made
            self.ledger.requested_in += total
            self.ledger.requested_out += total

    # ----- dispatch: rarer operations share a rule, so allocation and freeing stay common ---------

    @rule(data=st.data(), kind=st.sampled_from(["size", "stream", "double_free", "other_pool", "default_stream"]))
    def misuse(self, data, kind):
        if kind == "size":
            self.alloc_wrong(data.draw(BAD_SIZES))
        elif kind == "stream":
            self.alloc_on_foreign_stream(data)
        elif kind == "double_free" and self.freed:
            self.double_free(data, data.draw(st.sampled_from(["method", "pool"])))
        elif kind == "other_pool" and self.live():
            self.free_through_another_pool(data)
        elif kind == "default_stream":
            self.destroy_default_stream()

    @rule(data=st.data(), op=st.sampled_from(["new", "hold", "query", "synchronize", "destroy"]))
    def stream_op(self, data, op):
        if op == "new" and self.room_for_a_stream():
            self.new_stream()
        elif op == "hold":
            self.hold(data)
        elif op == "query":
            self.query(data)
        elif op == "synchronize":
            self.synchronize_stream(data)
        elif op == "destroy" and len(self.streams) > 1:
            self.destroy_stream(data, data.draw(st.booleans()))

    @rule(op=st.sampled_from(["synchronize", "empty_cache", "summaries", "reset_peaks"]))
    def pool_op(self, op):
        getattr(self, op)()

    @rule(data=st.data(), op=st.sampled_from(["start", "stop", "dump"]))
    def history_op(self, data, op):
        self.history(data, op)

    # ----- streams of other frameworks, and graph captures (cuda) ------------------------------

    @precondition(lambda self: self.cuda)
    @rule(data=st.data(), op=st.sampled_from(["import", "owner_destroys"]))
    def foreign_stream(self, data, op):
        """Another framework's streams: made through the driver, imported with
        ``external_stream``, used like the pool's own, forgotten by the pool (``destroy()`` or
        the last reference), and destroyed by their owner once the pool forgot them, or
        before, where the pool keeps nothing for them (see ``owner_destroys``)."""
        if op == "import" and self.room_for_a_stream():
            handle = FAKE.create_stream()
            stream = self.pool.external_stream(handle)
            log(f"external_stream(cuStreamCreate()) -> {stream.id}")
            self.streams[stream.id] = stream
            self.imported[stream.id] = handle
        elif op == "owner_destroys":
            self.owner_destroys(data)

    def owner_destroys(self, data):
        """``cuStreamDestroy`` by the owner of a stream the pool forgot, or (rust/pool/streams.rs:
        "its owner may have destroyed it already") of one it still knows but keeps nothing for:
        no block was ever made or recorded on it. Then the pool must never touch the handle
        again (the fake counts any use), and its ``Stream`` still goes: destroyed or dropped."""
        untouched = [s for s in self.imported if s in self.streams and s not in self.touched and not self.capturing(s)]
        choices = [("orphan", h) for h in self.orphans] + [("imported", s) for s in untouched]
        if not choices:
            return
        kind, key = pick(data, choices)
        if kind == "orphan":
            log("cuStreamDestroy(a stream the pool forgot)")
            FAKE.destroy_stream(key)
            del self.orphans[key]
            return
        log(f"cuStreamDestroy({key}) behind the pool's back")
        FAKE.destroy_stream(self.imported.pop(key))
        stream = self.streams.pop(key)
        self.slots.pop(key, None)
        self.stream_idle(key)  # its queued work still ran
        if data.draw(st.booleans()):
            log(f"destroy_stream({key})")
            stream.destroy()
            self.dead_streams = [*self.dead_streams[-2:], stream]
        else:
            log(f"drop_stream({key})")
            del stream
            gc.collect()

    @precondition(lambda self: self.cuda)
    @rule(
        data=st.data(),
        mode=st.sampled_from([0, 1, 2]),
        op=st.sampled_from(
            ["end", "alloc", "copy", "query", "synchronize", "destroy", "use", "export", "export_apart"]
        ),
    )
    def capture(self, data, mode, op):
        """Begins a capture (global, thread-local or relaxed mode) on a stream of the pool's or
        an imported one the pool holds a live block for (README: a capture on an imported
        stream the pool holds nothing for is not seen); or, while it runs, does ``op`` to the
        capturing stream, ending it at last: the pool must not have invalidated it."""
        if op == "export_apart":
            self.export_between_captures(data, mode)
            return
        if self.capture is not None:
            if op == "end":
                self.end_capture()
            else:
                self.during_capture(data, op)
            return
        if len(self.streams) == 1 and self.room_for_a_stream():
            if data.draw(st.booleans()):
                self.foreign_stream(data, "import")
            else:
                self.new_stream()
        sid = pick(data, sorted(self.streams))
        if sid == 0:
            return  # the legacy stream cannot be captured

        def seen() -> bool:
            return any(e.size and (e.stream == sid or sid in e.uses) for e in self.live())

        if sid in self.imported and not seen():
            # The graph's buffers, allocated before the capture (the pool then sees it).
            self.allocate(data.draw(st.integers(1, 4096)), sid, self.streams[sid])
            if not seen():
                return
        log(f"cuStreamBeginCapture({sid}, mode={mode})")
        FAKE.begin_capture(self.streams[sid].handle, mode)
        self.capture = Capture(sid, self.streams[sid])

    def during_capture(self, data, op: str) -> None:
        """What a program does to the capturing stream, right or wrong, while it captures."""
        sid, stream = self.capture.sid, self.capture.stream
        own = [e for e in self.live() if e.size and e.stream == sid]
        if op == "alloc":
            self.allocate(data.draw(st.integers(0, 4096)), sid, stream)
        elif op == "copy" and own:
            entry = pick(data, own)
            log(f"copy_out({entry.ptr!r}) during its stream's capture")
            try:
                entry.ptr.copy_to_host(0, 1) if data.draw(st.booleans()) else entry.ptr.copy_from_host(b"x")
            except ValueError as e:
                assert "captured into a CUDA graph" in str(e) and "cannot be copied" in str(e), e
            else:
                raise AssertionError("copied an allocation of a capturing stream")
        elif op in ("query", "synchronize"):
            log(f"{op}({sid}) during its capture")
            assert self.refused_during_capture(sid, getattr(stream, op))
        elif op == "destroy":
            log(f"destroy_stream({sid}) during its capture")
            assert self.external_destroy_refused(sid) or self.refused_during_capture(sid, stream.destroy)
        elif op == "use" and self.live():
            entry = pick(data, [e for e in self.live() if e.size] or [None])
            if entry is not None:
                self.use_on(data, entry, sid, stream, data.draw(st.booleans()))
        elif op == "export" and own:
            self.export_entry(data, pick(data, own), "capsule")

    def export_between_captures(self, data, mode: int) -> None:
        """A DLPack export between two independent captures: from a live allocation's stream,
        capturing already or begun here, to another framework's stream captured here. Ordering
        one after the other would merge the captures, which the driver answers by invalidating
        both: refused, and both go on (those begun here end here)."""

        def candidates() -> list[Entry]:
            return [e for e in self.live() if e.size and e.stream != 0 and e.stream in self.streams]

        if not candidates() and len(self.streams) > 1:
            sid = pick(data, sorted(self.streams)[1:])
            self.allocate(data.draw(st.integers(1, 4096)), sid, self.streams[sid])
        if not candidates():
            return
        entry = pick(data, candidates())
        producer, consumer = self.streams[entry.stream].handle, FAKE.create_stream()
        begun = not self.capturing(entry.stream)
        log(f"export({entry.ptr!r}) from capturing stream {entry.stream} to another capture (mode={mode})")
        if begun:
            FAKE.begin_capture(producer, mode)
        FAKE.begin_capture(consumer, data.draw(st.sampled_from([0, 1, 2])))
        before = entry.ptr.exports
        try:
            entry.ptr.__dlpack__(stream=consumer)
        except RuntimeError as e:
            assert "two different CUDA graphs" in str(e), e
        else:
            raise AssertionError("a capsule ordered a stream of one capture after another capture")
        assert entry.ptr.exports == before, "a failed export left its pin"
        assert FAKE.end_capture(consumer) == 0, "the consumer's capture was invalidated"
        assert FAKE.end_capture(producer) == 0 if begun else FAKE.capture_status(producer) == 1
        FAKE.destroy_stream(consumer)

    def end_capture(self):
        log(f"cuStreamEndCapture({self.capture.sid})")
        assert FAKE.end_capture(self.capture.stream.handle) == 0, "the capture was invalidated"
        self.capture = None
        # The frees held for it are done at the pool's next poll, after their streams' work.
        for p in self.pending:
            p.waits.discard(CAPTURE)

    # ----- invariants --------------------------------------------------------------------------

    @invariant()
    def consistent(self):
        if self.capture is not None:
            assert FAKE.capture_status(self.capture.stream.handle) == 1, "the capture was invalidated"
        self.observe_synchronizations()
        segments = self.pool.snapshot()["segments"]
        blocks = [b for segment in segments for b in segment["blocks"]]
        pending_now = {b["address"]: b["size"] for b in blocks if b["state"] == "active_pending_free"}
        held = {e.address for e in self.entries if e.freed and e.block}
        assert held <= set(pending_now), "freed bytes an export still holds went back to the pool"
        captured = {p.address for p in self.pending if CAPTURE in p.waits}
        assert captured <= set(pending_now), "a block freed during a capture that uses it is not pending"
        waiting = {p.address for p in self.pending if p.waits}
        assert waiting <= set(pending_now), "a block went back while a stream may still use it"
        # Blocks whose streams finished go back at the pool's next poll; those that did are gone.
        self.pending = [p for p in self.pending if p.waits or p.address in pending_now]
        assert set(pending_now) == held | {p.address for p in self.pending}, "unexpected pending blocks"
        live = [e.ptr for e in self.live()]
        check_pool(self.pool, live, pending=sum(pending_now.values()), ledger=self.ledger)
        self.no_overlap()
        if self.copies:
            self.contents_intact()
        if self.cuda:
            FAKE.check()

    def no_overlap(self):
        granule = rules_of(self.pool).granule
        spans = sorted((e.address, e.address + rounded(e.size, granule)) for e in self.entries if e.size)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, "a live or held block overlaps another"

    def contents_intact(self):
        """Every remembered write still reads back: from the pointer, or for a freed entry
        through its exports (nothing else may reach a freed block's bytes)."""
        for entry in self.entries:
            if not entry.writes or (not entry.freed and self.capturing(entry.stream)):
                continue
            if entry.freed:
                arrays = [x.array for x in self.exports_of(entry) if x.array is not None]
                if not arrays:
                    continue
                array = max(arrays, key=len)
                read = lambda start, n, array=array: array[start : start + n].tobytes()  # noqa: E731
                limit = len(array)
            else:
                read, limit = entry.ptr.copy_to_host, entry.size
            for start, expected in entry.expected():
                n = min(len(expected), limit - start)
                if n > 0:
                    assert read(start, n) == expected[:n], f"bytes of {entry.ptr!r} at {start} changed"
                    if not entry.freed:
                        self.copied_on(entry.stream)

    def teardown(self):
        log("teardown()")
        if self.capture is not None:
            self.end_capture()
        self.exports.clear()
        for entry in self.live():
            entry.ptr.free()
        self.entries.clear()
        gc.collect()
        self.pool.synchronize()
        self.pool.empty_cache()
        self.pool.check_invariants()
        shutil.rmtree(self.scratch, ignore_errors=True)
        assert self.pool.memory_reserved() == 0 and self.pool.device_memory_held() == 0, "memory leaked"
        if self.cuda:
            # Every pool on the device shares its context, and dropping one synchronizes it: this
            # one goes now, not at a collection in the middle of the next program.
            self.freed, self.kept_by_pointers, self.dead_streams, self.streams = [], [], [], {}
            self.pool = None  # type: ignore[assignment]
            gc.collect()
            FAKE.check_released()
            # The pool forgot its imported streams without destroying them: their owner does.
            for handle in [*self.imported.values(), *self.orphans]:
                FAKE.destroy_stream(handle)
            FAKE.check()
        # What outlives this program (Hypothesis's records of it) is never garbage of the next:
        # the collections above and in the next program need not scan it again.
        gc.freeze()


def _configured_case():
    """The test case ``GPUPOOL_MISUSE`` asks for: ``device,strategy,examples,steps[,log]``."""
    spec = os.environ.get("GPUPOOL_MISUSE")
    if not spec:
        return None
    device, strategy, examples, steps, *rest = spec.split(",")
    global LOG, STACKS
    LOG = Path(rest[0]) if rest else None
    if LOG is not None:
        # A parent that finds this child hung asks for its threads' stacks with SIGUSR1.
        STACKS = LOG.with_suffix(".stacks").open("w")
        faulthandler.register(signal.SIGUSR1, file=STACKS, all_threads=True)
    attributes = {"device": device, "strategy": strategy}
    case = type(f"Misuse_{device}_{strategy}", (MisuseMachine,), attributes).TestCase
    case.settings = settings(
        max_examples=int(examples),
        stateful_step_count=int(steps),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        # Shrinking a stateful failure can take Hypothesis five minutes; the step log already
        # holds the failing program, so the suites report at once and a replay may shrink.
        phases=[Phase.explicit, Phase.reuse, Phase.generate]
        + ([Phase.shrink] if os.environ.get("GPUPOOL_MISUSE_SHRINK") else []),
    )
    return case


TestMisuse = _configured_case()
