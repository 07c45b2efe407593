"""Stream-ordered allocation: no block reaches a stream while another stream may still use it."""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule

import gpupool
from pool_checks import EXAMPLES_SCALE, STRATEGIES, MiB

MODES = ("never", "completed", "wait")
STREAMS = st.integers(0, 3)
SIZES = st.one_of(st.integers(1, 64 * 1024), st.integers(1, 4 * MiB), st.integers(1, 24 * MiB))


@dataclass
class Live:
    ptr: gpupool.DevicePtr
    stream: int
    uses: set[int] = field(default_factory=set)


@dataclass
class Busy:
    """A freed range that stream ``stream`` may still be working on."""

    start: int
    end: int
    stream: int


class StreamMachine(RuleBasedStateMachine):
    mode = "completed"
    strategy = "pytorch"
    device = "sim"
    allocations = Bundle("allocations")

    def __init__(self) -> None:
        super().__init__()
        config = f"strategy:{self.strategy},cross_stream_reuse:{self.mode}"
        self.pool = gpupool.Pool(self.device, capacity=160 * MiB, config=config)
        self.streams = [self.pool.default_stream] + [self.pool.stream() for _ in range(3)]
        self.busy: list[Busy] = []

    def observe(self) -> None:
        """Work on an idle stream has finished: its freed ranges are safe from it."""
        idle = {i for i, s in enumerate(self.streams) if s.query()}
        self.busy = [b for b in self.busy if b.stream not in idle]

    @rule(target=allocations, size=SIZES, stream=STREAMS)
    def alloc(self, size, stream):
        try:
            ptr = self.pool.alloc(size, stream=self.streams[stream])
        except gpupool.OutOfMemoryError:
            return multiple()
        # The out-of-memory ladder synchronizes every stream; what it made idle is safe to reuse.
        self.observe()
        for b in self.busy:
            if b.stream != stream and b.start < ptr.ptr + size and ptr.ptr < b.end:
                # Only `wait` may hand it over, and then the new stream must wait for the old one.
                assert self.mode == "wait", f"block {ptr.ptr:#x} reached stream {stream} while {b.stream} uses it"
                assert not self.streams[stream].query(), "the new stream must wait on the old one"
        return Live(ptr, stream)

    @rule(live=allocations, stream=STREAMS)
    def record(self, live, stream):
        if live.ptr.freed:
            with pytest.raises(ValueError):
                live.ptr.record_stream(self.streams[stream])
            return
        live.ptr.record_stream(self.streams[stream])
        live.uses.add(stream)

    @rule(live=consumes(allocations))
    def free(self, live):
        if live.ptr.freed:
            return
        self.observe()
        live.ptr.free()
        for s in {live.stream} | live.uses:
            if not self.streams[s].query():
                self.busy.append(Busy(live.ptr.ptr, live.ptr.ptr + live.ptr.size, s))

    @rule(stream=STREAMS)
    def hold(self, stream):
        self.streams[stream].hold()

    @rule(stream=STREAMS)
    def synchronize_stream(self, stream):
        self.streams[stream].synchronize()

    @rule()
    def synchronize_pool(self):
        self.pool.synchronize()
        stats = self.pool.memory_stats()
        assert stats["active_bytes.all.current"] == stats["allocated_bytes.all.current"]

    @rule()
    def empty_cache(self):
        self.pool.empty_cache()

    @invariant()
    def consistent(self):
        self.observe()
        self.pool.check_invariants()
        stats = self.pool.memory_stats()
        pending = sum(
            b["size"]
            for seg in self.pool.snapshot()["segments"]
            for b in seg["blocks"]
            if b["state"] == "active_pending_free"
        )
        assert stats["active_bytes.all.current"] - stats["allocated_bytes.all.current"] == pending


# Examples per (mode, strategy, device): all of them together stay within about a minute.
for _mode in MODES:
    for _strategy in STRATEGIES:
        for _device, _examples in (("sim", 30), ("host", 10)):
            _attributes = {"mode": _mode, "strategy": _strategy, "device": _device}
            _name = f"{_mode}_{_strategy}_{_device}"
            _case = type(f"StreamMachine_{_name}", (StreamMachine,), _attributes).TestCase
            _case.settings = settings(max_examples=_examples * EXAMPLES_SCALE, stateful_step_count=50)
            globals()[f"TestStreams_{_name}"] = _case
# Module-level names holding a TestCase would be collected a second time.
del _case


@pytest.fixture
def pool():
    return gpupool.Pool("sim", capacity="1GiB", config="strategy:pytorch")


def test_record_stream_defers_the_free_until_the_stream_synchronizes(pool):
    s1, s2 = pool.stream(), pool.stream()
    p = pool.alloc(3 * MiB, stream=s1)
    s2.hold()
    p.record_stream(s2)
    p.free()
    stats = pool.memory_stats()
    assert stats["allocated_bytes.all.current"] == 0
    assert stats["active_bytes.all.current"] == 3 * MiB
    q = pool.alloc(3 * MiB, stream=s1)
    assert q.ptr != p.ptr, "a pending block must not be reused"
    s2.synchronize()
    q.free()
    r = pool.alloc(3 * MiB, stream=s1)
    assert r.ptr == p.ptr
    assert "Active memory" in pool.memory_summary()


def test_pool_synchronize_returns_pending_blocks(pool):
    s = pool.stream()
    s.hold()
    p = pool.alloc(MiB)
    p.record_stream(s)
    p.free()
    assert pool.memory_stats()["active.all.current"] == 1
    pool.synchronize()
    assert pool.memory_stats()["active.all.current"] == 0
    assert s.query()


def test_active_memory_row_shows_pending_bytes(pool):
    s = pool.stream()
    s.hold()
    p = pool.alloc(4 * MiB)
    p.record_stream(s)
    p.free()
    summary = pool.memory_summary().splitlines()
    row = {name: next(line for line in summary if line.startswith(f"| {name}")) for name in ("Active", "Allocated")}
    assert row["Active"].split("|")[2].strip() == "4096 KiB"
    assert row["Allocated"].split("|")[2].strip() == "0 B"


def _alternating_reserved(mode: str) -> int:
    pool = gpupool.Pool("sim", capacity="1GiB", config=f"strategy:pytorch,cross_stream_reuse:{mode}")
    streams = [pool.stream(), pool.stream()]
    for step in range(20):
        ptrs = [pool.alloc(12 * MiB, stream=streams[step % 2]) for _ in range(4)]
        for p in ptrs:
            p.free()
    return pool.max_memory_reserved()


def test_completed_reuse_reserves_less_than_never_on_alternating_streams():
    never, completed = _alternating_reserved("never"), _alternating_reserved("completed")
    assert completed < never
    assert (never, completed) == (96 * MiB, 48 * MiB)


def test_wait_hands_a_busy_block_to_another_stream_after_a_wait():
    pool = gpupool.Pool("sim", capacity="1GiB", config="strategy:pytorch,cross_stream_reuse:wait")
    s1, s2 = pool.stream(), pool.stream()
    s1.hold()
    p = pool.alloc(12 * MiB, stream=s1)
    address = p.ptr
    p.free()
    q = pool.alloc(12 * MiB, stream=s2)
    assert q.ptr == address
    assert not s2.query(), "s2 now waits for s1's queued work"
    s1.synchronize()
    assert s2.query()
    assert pool.max_memory_reserved() == 12 * MiB


def test_completed_waits_for_a_busy_stream():
    pool = gpupool.Pool("sim", capacity="1GiB", config="strategy:pytorch")
    s1, s2 = pool.stream(), pool.stream()
    s1.hold()
    p = pool.alloc(12 * MiB, stream=s1)
    address = p.ptr
    p.free()
    elsewhere = pool.alloc(12 * MiB, stream=s2)
    assert elsewhere.ptr != address
    s1.synchronize()
    assert pool.alloc(12 * MiB, stream=s2).ptr == address


def test_stream_misuse_raises_clear_errors(pool):
    other = gpupool.Pool("sim", capacity="1GiB")
    foreign = other.stream()
    with pytest.raises(ValueError, match="another pool"):
        pool.alloc(10, stream=foreign)
    s = pool.stream()
    p = pool.alloc(10)
    with pytest.raises(ValueError, match="another pool"):
        p.record_stream(foreign)
    s.destroy()
    with pytest.raises(ValueError, match="destroyed"):
        pool.alloc(10, stream=s)
    with pytest.raises(ValueError, match="destroyed"):
        p.record_stream(s)
    with pytest.raises(ValueError, match="destroyed"):
        s.hold()
    with pytest.raises(ValueError, match="default stream"):
        pool.default_stream.destroy()
    p.free()
    with pytest.raises(ValueError, match="freed"):
        p.record_stream(pool.stream())
    pool.check_invariants()


def test_destroyed_stream_blocks_serve_other_streams():
    pool = gpupool.Pool("sim", capacity="1GiB", config="cross_stream_reuse:never")
    s1, s2 = pool.stream(), pool.stream()
    p = pool.alloc(12 * MiB, stream=s1)
    address = p.ptr
    p.free()
    s1.destroy()
    assert pool.alloc(12 * MiB, stream=s2).ptr == address
    pool.check_invariants()


def test_an_allocation_keeps_only_the_live_streams_it_was_used_on(pool):
    # A pointer keeps the streams it was used on alive, and kept destroyed ones too: a weight
    # recorded on a fresh stream per step held every step's Stream object until it was freed.
    import sys

    ptr = pool.alloc(MiB)
    first = pool.stream()
    ptr.record_stream(first)
    first.destroy()
    kept = sys.getrefcount(first)
    for _ in range(3):
        stream = pool.stream()
        ptr.record_stream(stream)
        stream.destroy()
    assert sys.getrefcount(first) == kept - 1
    ptr.free()
    pool.check_invariants()


def test_a_freed_pointer_lets_its_streams_go_once_no_export_holds_its_bytes():
    # A pointer kept after its free (for a double-free check, say) must not keep the streams it
    # was made and used on alive, or their owner could not destroy them safely; while an export
    # holds the bytes, their free still needs those streams.
    import sys

    pool = gpupool.Pool("host", capacity="64MiB")
    made, used = pool.stream(), pool.stream()
    plain, exported = pool.alloc(MiB, stream=made), pool.alloc(MiB, stream=made)
    plain.record_stream(used)
    exported.record_stream(used)
    counts = lambda: (sys.getrefcount(made), sys.getrefcount(used))  # noqa: E731
    before = counts()
    plain.free()
    assert counts() == (before[0] - 1, before[1] - 1)
    view = exported.view("uint8")
    exported.free()
    assert counts() == (before[0] - 1, before[1] - 1), "the export's bytes still wait on both streams"
    del view
    assert counts() == (before[0] - 2, before[1] - 2)
    with pytest.raises(ValueError, match="was freed"):
        plain.record_stream(used)
    assert counts() == (before[0] - 2, before[1] - 2)
    pool.check_invariants()


def test_a_trace_of_many_streams_costs_memory_per_block_not_per_bin(tmp_path):
    # A pool keeps free-block bins per stream; each stream's bins used to take 13 KiB at once,
    # so a 50,000-stream trace (2 MiB of CSV) replayed in about 680 MiB. Bins now start empty.
    import subprocess
    import sys

    path = tmp_path / "streams.csv"
    rows = (f"0,{i}.0,allocate,{0x1000 + i * 0x1000:#x},512,{i + 1:#x}" for i in range(50_000))
    path.write_text("Thread,Time,Action,Pointer,Size,Stream\n" + "\n".join(rows) + "\n")
    code = (
        "import resource, sys, gpupool.trace\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "result = gpupool.trace.replay(sys.argv[1], 'strategy:pytorch')\n"
        "print(result.ooms, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    ooms, grown_mib = map(int, done.stdout.split())
    assert ooms == 0
    assert grown_mib < 100, f"the replay grew the process by {grown_mib} MiB"
