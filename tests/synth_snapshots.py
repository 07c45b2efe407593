"""Synthesized PyTorch memory snapshots whose ground truth is known, for checking how faithfully
``gpupool advise`` replays what a job did.

Each replays the allocation history of one shared snapshot on a ``sim`` pool that imitates
PyTorch's allocator (plain or expandable segments), records the pool's history from a tenth of
the way in (so that, as in real snapshots, blocks are live and segments cached before the first
entry) and takes the pool's snapshot. The shapes are what real histories hold and the shared
snapshots lack: ``empty_cache`` bursts, the out-of-memory path's release-and-retry
(``oom_retry``), and a run that died of an out-of-memory error and dumped its snapshot (``oom``).
The pool's own figures (peak reserved bytes, segment decisions, retries) are the truth that the
replay's are compared against.

Some histories cannot retry successfully at any capacity (their memory only grows, so the pool
has nothing to release when it runs short): their ``oom_retry`` raises ``NoRetry``. Where the
whole history never retries but a lower capacity does before the run would fail, the run stops
just before that failure, as a job that dumped its snapshot then.

Run as a script, it prints one line per case with ``gpupool advise``'s fidelity figures.
"""

from __future__ import annotations

import functools
import pathlib
import random
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import gpupool
from gpupool import trace as gtrace
from gpupool._advice.analysis import advise
from gpupool._advice.settings import gpupool_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The shared snapshots with an allocation history, relative to the repository root.
SOURCES = [
    f"../shared/snapshots/{name}.pickle"
    for name in (
        "MAGMA27__memory_snapshot",
        "Wedsonlin__medium_1024_training_memory_snapshot",
        "Wedsonlin__medium_128_inference_memory_snapshot",
        "Wedsonlin__medium_128_training_memory_snapshot",
        "Wedsonlin__medium_512_training_memory_snapshot",
        "bcrafton__memory_snapshot",
        "kkaitlyn111__memory_files_memory_ctx128_forward_",
        "kkaitlyn111__memory_files_memory_ctx128_fullstep_",
        "notHanmin__memory_snapshot",
        "notHanmin__memory_snapshot_forward",
    )
]
SHAPES = ("empty_cache", "oom_retry", "oom")
EXPANDABLE_ENV = "expandable_segments:True"
MiB = 1 << 20
GiB = 1 << 30
# `sim` needs a capacity: a pebibyte is one no history here comes near.
UNLIMITED = 1 << 50
RECORD_FROM = 0.1
MAX_ENTRIES = 10_000_000
# Reserved bytes are whole 2 MiB pages: capacities closer than that behave alike.
RESOLUTION = 2 * MiB
OOM_MARGIN = 0.01
# How many steps of OOM_MARGIN below the least capacity to look for a successful retry.
RETRY_STEPS = 15
SEGMENT_ACTIONS = frozenset(("segment_alloc", "segment_free", "segment_map", "segment_unmap"))
RELEASES = frozenset(("segment_free", "segment_unmap"))

# One replayed event: (action, address, size, stream), action "alloc" or "free".
Op = tuple[str, int, int, int]


class NoRetry(ValueError):
    """No capacity makes this history's out-of-memory path release memory and retry successfully:
    whenever the pool would need more, nothing it could release makes room (a forward pass,
    whose memory only grows, say)."""


@dataclass(frozen=True)
class GroundTruth:
    """What the pool did while recording: the figures a faithful replay reproduces."""

    capacity: int | None  # None: unlimited
    # The source's allocations and frees replayed, of all of them: an `oom_retry` run may stop
    # early, as a job that dumped its snapshot then.
    events_replayed: int
    events_in_source: int
    peak_reserved_bytes: int
    segment_decisions: int
    empty_cache_calls: int
    # empty_cache calls that gave memory back, each a burst of segment_free / segment_unmap.
    empty_cache_releases: int
    # Out-of-memory releases and retries; in an `oom` run, the failing request's own counts too.
    retries: int
    ooms: int


class Synthesized(NamedTuple):
    snapshot: dict[str, Any]
    truth: GroundTruth


def all_cases() -> list[tuple[str, str, bool]]:
    """Every (source, shape, expandable) combination; some ``oom_retry`` ones raise NoRetry."""
    return [(s, shape, e) for s in SOURCES for shape in SHAPES for e in (False, True)]


def synthesize(source: str, shape: str, expandable: bool = False, seed: int = 0) -> dict[str, Any]:
    """The snapshot of ``source``'s history replayed in ``shape`` (one of ``SHAPES``)."""
    return synthesized(source, shape, expandable, seed).snapshot


def ground_truth(source: str, shape: str, expandable: bool = False, seed: int = 0) -> GroundTruth:
    """What the pool behind ``synthesize(source, shape, expandable, seed)`` did."""
    return synthesized(source, shape, expandable, seed).truth


def synthesized(source: str, shape: str, expandable: bool = False, seed: int = 0) -> Synthesized:
    """The snapshot and its ground truth. Every stream of the source gets a pool stream of its
    own (the source's stream 0 is the pool's default stream). ``seed`` places the
    ``empty_cache`` calls; the other shapes do not depend on it."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, not {shape!r}")
    ops = _ops(source)
    if shape == "empty_cache":
        return _record(ops, expandable, None, _flush_points(ops, expandable, seed))
    if shape == "oom_retry":
        capacity, stop = retry_run(source, expandable)
        return _record(ops, expandable, capacity, stop=stop)
    result = _record(ops, expandable, failing_capacity(source, expandable))
    assert result.truth.ooms == 1, f"{source}: no out-of-memory error after recording began"
    return result


@functools.cache
def _ops(source: str) -> tuple[Op, ...]:
    """The source's allocations and frees, without zero-byte ones (nor the frees of those)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        events = gtrace.load(ROOT / source)
    return tuple((e.action, e.address, e.size, e.stream) for e in events if e.action != "oom" and e.size > 0)


def _pool(expandable: bool, capacity: int | None) -> gpupool.Pool:
    env = EXPANDABLE_ENV if expandable else ""
    return gpupool.Pool(device="sim", capacity=capacity or UNLIMITED, config=gpupool_config(env))


def _run(
    pool: gpupool.Pool,
    ops: tuple[Op, ...],
    on_event: Callable[[int], bool] | None = None,
    live: dict[int, gpupool.DevicePtr] | None = None,
) -> int:
    """Replays ``ops`` on ``pool``, calling ``on_event(index)`` before each; stops at the first
    allocation that fails for good, as the job would have, or where ``on_event`` returns True.
    Returns the index it stopped at, else len(ops). The allocations left live stay in ``live``:
    dropping them frees them, which a snapshot taken afterwards would record."""
    live = {} if live is None else live
    streams: dict[int, gpupool.Stream] = {}
    for index, (action, address, size, stream) in enumerate(ops):
        if on_event is not None and on_event(index):
            return index
        if action == "alloc":
            where = pool.default_stream if stream == 0 else streams.get(stream)
            if where is None:
                where = streams[stream] = pool.stream()
            try:
                live[address] = pool.alloc(size, where)
            except gpupool.OutOfMemoryError:
                return index
        elif (ptr := live.pop(address, None)) is not None:
            ptr.free()
    return len(ops)


def _fits(ops: tuple[Op, ...], expandable: bool, capacity: int) -> bool:
    return _run(_pool(expandable, capacity), ops) == len(ops)


@functools.cache
def least_capacity(source: str, expandable: bool) -> int:
    """The least capacity (to 2 MiB) at which the whole history runs without an out-of-memory
    error, by bisection between its peak live bytes and its unlimited peak reserved bytes.
    Failing is not monotonic in capacity; this is one edge between failing and fitting."""
    ops = _ops(source)
    unlimited = _pool(expandable, None)
    _run(unlimited, ops)
    low, high = _peak_live(ops), unlimited.max_memory_reserved()
    while high - low > RESOLUTION:
        middle = (low + high) // 2 // RESOLUTION * RESOLUTION
        if middle <= low:
            break
        if _fits(ops, expandable, middle):
            high = middle
        else:
            low = middle
    return high


def _peak_live(ops: tuple[Op, ...]) -> int:
    live, peak, sizes = 0, 0, {}
    for action, address, size, _ in ops:
        if action == "alloc":
            sizes[address] = size
            live += size
            peak = max(peak, live)
        else:
            live -= sizes.pop(address, 0)
    return peak


@functools.cache
def retry_run(source: str, expandable: bool) -> tuple[int, int]:
    """``(capacity, events)``: a run of the first ``events`` of the history whose out-of-memory
    path releases memory and retries after recording began, and no allocation fails for good.
    The least capacity the whole history fits, if it retries there; else (its peak needs all of
    that, with nothing to release) 1% lower and down to 15%, the run cut just before its first
    failing allocation. NoRetry if none does."""
    ops = _ops(source)
    least = least_capacity(source, expandable)
    for step in range(RETRY_STEPS + 1):
        capacity = int(least * (1 - OOM_MARGIN * step))
        pool = _pool(expandable, capacity)
        stop = _run(pool, ops)
        if stop <= _begin(ops):
            break  # nothing of it recorded; lower capacities usually fail sooner still
        # The failing allocation went through a retry of its own; only earlier ones succeeded.
        if pool.memory_stats()["num_alloc_retries"] > (stop < len(ops)):
            if _record(ops, expandable, capacity, stop=stop).truth.retries:
                return capacity, stop
    raise NoRetry(f"{source}: no capacity from {least} B down {RETRY_STEPS}% retries successfully")


@functools.cache
def failing_capacity(source: str, expandable: bool) -> int:
    """A capacity about 1% below the least the history fits, at which it fails after recording
    began: 1% below, lower still while the history fits there; if it fails before recording
    began (the peak is that early), closer to the least in 2 MiB steps."""
    ops, least = _ops(source), least_capacity(source, expandable)
    capacity, stop = least, len(ops)
    while stop == len(ops):
        capacity = int(capacity * (1 - OOM_MARGIN))
        stop = _run(_pool(expandable, capacity), ops)
    for candidate in range(capacity, least, RESOLUTION):
        if _begin(ops) <= _run(_pool(expandable, candidate), ops) < len(ops):
            return candidate
    raise AssertionError(f"{source}: no capacity below {least} B fails after recording began")


def _flush_points(ops: tuple[Op, ...], expandable: bool, seed: int) -> list[int]:
    """3 to 6 event indices after recording begins, before which ``empty_cache`` is called. If
    none of them finds memory to give back, the first moves on to the first event that does."""
    rng = random.Random(seed)
    points = sorted(rng.sample(range(_begin(ops) + 1, len(ops)), rng.randint(3, 6)))
    first = _first_release(ops, expandable, points)
    return points if first is None or first in points else sorted([first, *points[1:]])


def _first_release(ops: tuple[Op, ...], expandable: bool, points: list[int]) -> int | None:
    """The first event, from ``points[0]`` on, before which ``empty_cache`` gives memory back,
    calling it before each of ``points`` and wherever memory may be cached. A call that gives
    nothing back changes nothing, so the run is the one with only the releasing call."""
    pool, points_at = _pool(expandable, None), set(points)

    def on_event(index: int) -> bool:
        if index < points[0] or (index not in points_at and not _maybe_cached(pool)):
            return False
        reserved = pool.memory_reserved()
        pool.empty_cache()
        return pool.memory_reserved() < reserved

    stop = _run(pool, ops, on_event)
    return stop if stop < len(ops) else None


def _maybe_cached(pool: gpupool.Pool) -> bool:
    """Whether reserved bytes exceed the active ones and the free pieces of split segments: a
    segment is wholly free (exact for plain segments; for expandable ones, pages may be)."""
    s = pool.memory_stats()
    held = s["active_bytes.all.current"] + s["inactive_split_bytes.all.current"]
    return s["reserved_bytes.all.current"] > held


def release_bursts(entries: list[dict[str, Any]]) -> list[tuple[int, str | None]]:
    """Each run of ``segment_free`` / ``segment_unmap`` entries in a history, as its length and
    the action of the entry after it (None at the end)."""
    bursts: list[tuple[int, str | None]] = []
    length = 0
    for e in [*entries, None]:
        action = None if e is None else e["action"]
        if action in RELEASES:
            length += 1
        elif length:
            bursts.append((length, action))
            length = 0
    return bursts


def _begin(ops: tuple[Op, ...]) -> int:
    """The event before which recording begins."""
    return int(len(ops) * RECORD_FROM)


def _record(
    ops: tuple[Op, ...],
    expandable: bool,
    capacity: int | None,
    flushes: list[int] | None = None,
    stop: int | None = None,
) -> Synthesized:
    """Replays the first ``stop`` of ``ops`` (all by default), recording from a tenth of all of
    them on, with ``empty_cache`` before the events at ``flushes``."""
    pool, begin, flushes_at = _pool(expandable, capacity), _begin(ops), set(flushes or ())
    released = 0

    def on_event(index: int) -> bool:
        nonlocal released
        if index == begin:
            pool.record_history(True, max_entries=MAX_ENTRIES)
            # The truth is what happened while recording, as a snapshot's figures are.
            pool.reset_peak_memory_stats()
            pool.reset_accumulated_memory_stats()
        if index in flushes_at:
            reserved = pool.memory_reserved()
            pool.empty_cache()
            released += pool.memory_reserved() < reserved
        return False

    live: dict[int, gpupool.DevicePtr] = {}
    replayed = _run(pool, ops[:stop], on_event, live)
    snapshot = pool.snapshot()
    snapshot["allocator_settings"] = _pytorch_settings(expandable)
    stats = pool.memory_stats()
    truth = GroundTruth(
        capacity=capacity,
        events_replayed=replayed,
        events_in_source=len(ops),
        peak_reserved_bytes=stats["reserved_bytes.all.peak"],
        segment_decisions=sum(e["action"] in SEGMENT_ACTIONS for e in snapshot["device_traces"][0]),
        empty_cache_calls=len(flushes_at),
        empty_cache_releases=released,
        retries=stats["num_alloc_retries"],
        ooms=stats["num_ooms"],
    )
    return Synthesized(snapshot, truth)


def _pytorch_settings(expandable: bool) -> dict[str, Any]:
    """``allocator_settings`` as PyTorch 2.x records its defaults (kkaitlyn111's fields)."""
    return {
        "PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE_ENV if expandable else "",
        "max_split_size": -1,
        "garbage_collection_threshold": 0.0,
        "expandable_segments": expandable,
        "pinned_num_register_threads": 1,
        "release_lock_on_cudamalloc": False,
        "pinned_use_cuda_host_register": False,
        # Divisions per power-of-two interval start in MiB; 0 everywhere: no rounding.
        "roundup_power2_divisions": {str(1 << i): 0 for i in range(16)},
    }


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _self_check() -> None:
    """One line per case: the generator's figures (``run``: the share of the source's events
    replayed), then ``gpupool advise``'s fidelity: the recorded peak reserved bytes (the pool's
    truth, and advise's from the history), the replayed peak as a share of the recorded one,
    and the segment decisions matched."""
    print(
        f"{'source':<34} {'shape':<11} {'exp':<3} {'capacity':>11} {'retry':>5} {'oom':>3} {'ec':>3} "
        f"{'run':>6} {'entries':>7} {'seg ev':>6} {'secs':>5} | {'truth peak':>11} {'advise rec':>11} "
        f"{'replayed':>8} {'matched':>7}"
    )
    for source, shape, expandable in all_cases():
        name = pathlib.Path(source).stem[:34]
        for cached in (_ops, least_capacity, retry_run, failing_capacity):
            cached.cache_clear()  # each case timed from scratch, loading included
        started = time.perf_counter()
        try:
            snapshot, truth = synthesized(source, shape, expandable)
        except NoRetry:
            seconds = time.perf_counter() - started
            print(f"{name:<34} {shape:<11} {'T' if expandable else 'F':<3} {'NoRetry':>11} {seconds:>42.2f}")
            continue
        seconds = time.perf_counter() - started
        entries = snapshot["device_traces"][0]
        recorded = advise(snapshot).recorded
        peak = recorded.peak_reserved_bytes
        replayed = None if not peak else recorded.replayed_peak_reserved_bytes / peak
        print(
            f"{name:<34} {shape:<11} {'T' if expandable else 'F':<3} "
            f"{'-' if truth.capacity is None else f'{truth.capacity / GiB:.3f}G':>11} {truth.retries:>5} "
            f"{truth.ooms:>3} {truth.empty_cache_calls:>3} {truth.events_replayed / truth.events_in_source:>6.1%} "
            f"{len(entries):>7} {truth.segment_decisions:>6} "
            f"{seconds:>5.2f} | {truth.peak_reserved_bytes / GiB:>10.3f}G "
            f"{'-' if peak is None else f'{peak / GiB:.3f}G':>11} {_percent(replayed):>8} "
            f"{_percent(recorded.segment_decisions_matched):>7}"
        )


if __name__ == "__main__":
    _self_check()
