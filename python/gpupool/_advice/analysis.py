"""The advice itself: load, rebuild the start, replay the user's settings against the record,
replay every candidate (in parallel: the native replay releases the GIL), recommend."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpupool import _native
from gpupool import trace as gtrace
from gpupool._advice import candidates as _candidates
from gpupool._advice import fidelity, settings, sites, snapshot, start
from gpupool._advice.advice import TOLERANCE, Advice, CandidateResult, Recommendation, Recorded
from gpupool._advice.snapshot import DeviceRecord, Snapshot

TOP_SITES = 10
# What gpupool's strategies are recommended against: another must save more than the search's
# tolerance to replace it.
GPUPOOL_ANCHOR = "strategy:default"
GiB = 1 << 30

# Called with (replays done, replays in all, what is running) as the work goes on.
Progress = Callable[[int, int, str], None]


def _replay_all(
    trace: _native.Trace,
    options: Sequence[_candidates.Candidate],
    state: start.StartState,
    progress: Progress | None,
    workers: int | None = None,
) -> list[tuple[Any, list[tuple[str, int]]]]:
    """Every candidate with its min-capacity search, on ``workers`` threads (one per core by
    default): those that ``Candidate.seeded`` says from the recorded start (the as-run one with
    its segment decisions), the others from the blocks live at the start. Each repeats the job's
    ``empty_cache()`` calls; the configuration that ran also repeats the out-of-memory path's
    releases, on the GPU the job had where its ``oom`` entries say, so that the recorded errors
    happen again where they happened. The others run their own out-of-memory paths."""
    segments = [(s.address, s.size, s.small, s.stream) for s in state.segments]

    def run(c: _candidates.Candidate) -> tuple[Any, list[tuple[str, int]]]:
        job, capacity = ("as_run", trace.capacity) if c.as_run else ("honour", None)
        if c.seeded:
            result, decisions, _ = _native.replay_from_start(
                trace, c.config, segments, True, c.as_run, capacity, job=job
            )
            return result, decisions
        return _native.replay(trace, c.config, capacity, True, tolerance=TOLERANCE, job=job), []

    if progress:
        progress(0, len(options), "replaying")
    workers = max(1, min(len(options), workers or os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as executor:
        futures = [executor.submit(run, c) for c in options]
        results = []
        for done, future in enumerate(futures, 1):
            results.append(future.result())
            if progress:
                progress(done, len(options), options[done - 1].label)
    return results


def _candidate_result(c: _candidates.Candidate, result: Any, capacity: int | None) -> CandidateResult:
    # None when no capacity the search tried fits (a tiny per_process_memory_fraction, say).
    minimum = result.min_capacity_bytes
    fits = None if capacity is None else minimum is not None and minimum <= capacity
    return CandidateResult(
        config=c.env,
        family=c.family,
        gpupool_config=c.config,
        as_run=c.as_run,
        peak_reserved_bytes=result.peak_reserved_bytes,
        min_capacity_bytes=minimum,
        fragmentation_bytes=result.peak_reserved_bytes - result.peak_live_bytes,
        driver_calls=result.device_calls,
        fits=fits,
        headroom_bytes=None if capacity is None or minimum is None else capacity - minimum,
        min_capacity_corrected=result.min_capacity_corrected,
        timeline=result.timeline,
    )


def _recommend(results: Sequence[CandidateResult], family: str) -> Recommendation:
    """The family's configuration that needs the smallest device (fewer driver calls break
    ties), unless it saves no more than the search's tolerance against the family's anchor:
    what the user ran for PyTorch's settings, gpupool's default strategy for gpupool's. A
    difference that small is within the search's error, and the other may cost many times
    the driver calls (`pages` maps every 2 MiB page on its own)."""
    as_run = next(r for r in results if r.as_run)
    # One that no capacity the search tried fits comes last; the savings against one are unknown.
    best = min(
        (r for r in results if r.family == family),
        key=lambda r: (r.min_capacity_bytes is None, r.min_capacity_bytes or 0, r.driver_calls),
    )
    anchor = as_run if family == "pytorch" else next((r for r in results if r.config == GPUPOOL_ANCHOR), best)
    held, needs = anchor.min_capacity_bytes, best.min_capacity_bytes
    if needs is None or (held is not None and held - needs <= TOLERANCE * held):
        best = anchor
    ran, needs = as_run.min_capacity_bytes, best.min_capacity_bytes
    saved = None if ran is None or needs is None else ran - needs
    variable = "PYTORCH_ALLOC_CONF" if family == "pytorch" else "GPUPOOL_ALLOC_CONF"
    return Recommendation(
        family=family,
        config=best.config,
        env=f"{variable}={best.env}",
        min_capacity_bytes=needs,
        saved_bytes=saved,
        saved_fraction=None if saved is None else saved / max(ran or 0, 1),
    )


def _start_notes(record: DeviceRecord, state: start.StartState, scope: str) -> list[str]:
    notes = []
    if scope == "segments":
        notes.append(
            "No allocation history, only the segments at the snapshot: the figures are for holding "
            "the blocks live at that moment. The peak over the run, the minimum device for the whole "
            "job and the allocator's decisions cannot be answered from this file; record a history "
            "with torch.cuda.memory._record_memory_history() before the job's peak."
        )
        histories = sum(b.carries_history for s in record.segments for b in s.blocks)
        if histories:
            notes.append(
                f"{histories} blocks carry a 'history' (the allocations last made in each, as PyTorch 1.13 and "
                "2.0 record them): it gives the live blocks' requested sizes and stack frames, but not when "
                "allocations were made or freed, so it is not replayed. PyTorch 2.0 and later record the history "
                "the replay needs (2.0 keeps one entry unless trace_alloc_max_entries is raised)."
            )
    elif state.blocks or state.segments:
        held = sum(b.requested for b in state.blocks)
        notes.append(
            f"Recording began mid-run: {len(state.blocks)} blocks ({held / GiB:.2f} GiB) were live and "
            f"{len(state.segments)} segments ({state.reserved_bytes / GiB:.2f} GiB) reserved before its "
            "first entry; replays start from them."
        )
    if state.stray_blocks:
        notes.append(f"{state.stray_blocks} live blocks lie outside every segment the snapshot lists.")
    private = [s for s in record.segments if s.private]
    if private:
        held = sum(s.size for s in private) / GiB
        notes.append(
            f"{len(private)} segments ({held:.2f} GiB) belong to private pools (CUDA graphs); replays treat "
            "their free space as the default pool's, so they may reuse memory PyTorch kept for the graphs."
        )
    failures = record.actions["oom"]
    if failures:
        notes.append(
            f"The recorded run hit {failures} out-of-memory errors. Replays try those requests again and free them at "
            "once when served: min capacities are the devices that run the history without them."
        )
    for action, count in sorted(record.skipped_actions.items()):
        notes.append(f"Skipped {count} '{action}' entries this version does not know.")
    return notes


def _recorded(
    record: DeviceRecord,
    ran: settings.Settings,
    state: start.StartState,
    trace: _native.Trace,
    as_run: Any,
    seeded: bool,
    replayed_decisions: list[tuple[str, int]],
) -> tuple[Recorded, list[str]]:
    decisions = fidelity.recorded_decisions(record.rows)
    notes = []
    if record.allocations and not seeded:
        notes.append(
            "Runs on the driver's pool (cudaMallocAsync) are replayed from their live blocks, not their segments."
        )
    if ran.inert:
        notes.append("Settings accepted without effect on device memory: " + ", ".join(ran.inert) + ".")
    if ran.unknown:
        notes.append("Recorded settings not simulated: " + "; ".join(ran.unknown) + ".")
    if not ran.recorded:
        shown = ", with the expandable segments its segments show" if ran.expandable else ""
        notes.append(f"The snapshot records no allocator settings: PyTorch's defaults are assumed{shown}.")
    actions = trace.action_counts()
    recorded = Recorded(
        config=ran.env,
        settings_recorded=ran.recorded,
        peak_reserved_bytes=fidelity.recorded_peak_reserved(decisions, state.reserved_bytes),
        replayed_peak_reserved_bytes=as_run.peak_reserved_bytes,
        segment_decisions_matched=fidelity.matched(decisions, replayed_decisions) if seeded else None,
        segment_decisions=len(decisions),
        replayed_segment_decisions=len(replayed_decisions) if seeded else None,
        replayed_from="recorded start" if seeded else "live blocks",
        start_reserved_bytes=state.reserved_bytes,
        inert_keys=list(ran.inert),
        largest_gap_bytes=as_run.largest_gap_bytes,
        empty_cache_calls=actions.get("empty_cache", 0),
        oom_releases=actions.get("oom_release", 0),
        ooms=actions.get("oom", 0),
        ooms_repeated=as_run.ooms_as_recorded,
        timeline=(as_run.timeline[0], as_run.recorded_reserved_bytes),
    )
    return recorded, notes


def _corrected_notes(results: Sequence[CandidateResult]) -> list[str]:
    moved = [r.label for r in results if r.min_capacity_corrected]
    if not moved:
        return []
    return [
        "The bisection's min capacity did not hold when replayed (an out-of-memory error on it, or none "
        f"{TOLERANCE:.1%} below it) for {', '.join(moved)}: a search past it found the one shown."
    ]


def advise_device(
    name: str,
    record: DeviceRecord,
    ran: settings.Settings,
    capacity: int | None = None,
    progress: Progress | None = None,
) -> Advice:
    """The advice for one device's history and segments, with ``ran`` the settings in effect."""
    state = start.starting_state(record.rows, record.segments)
    where = f"{name}, device {record.device}"
    before = [(b.address, b.requested, b.stream) for b in state.blocks]
    final_reserved = sum(s.size for s in record.segments)
    trace = _native.Trace.from_snapshot_entries(where, record.rows, before, final_reserved)
    scope = "history" if record.allocations else "segments"
    options = _candidates.candidates(ran.env)
    replays = _replay_all(trace, options, state, progress)
    # Without a capacity given, what fits is said against the GPU the job had, where known.
    capacity_source = "given" if capacity is not None else "oom entries" if trace.capacity is not None else None
    capacity = capacity if capacity is not None else trace.capacity
    results = [_candidate_result(c, r, capacity) for c, (r, _) in zip(options, replays, strict=True)]
    at = next(i for i, c in enumerate(options) if c.as_run)
    recorded, recorded_notes = _recorded(record, ran, state, trace, replays[at][0], options[at].seeded, replays[at][1])
    frames_at_start = {b.address: b.frames for s in record.segments for b in s.blocks if b.live}
    start_blocks = [(b.address, b.requested, frames_at_start.get(b.address, ())) for b in state.blocks]
    return Advice(
        trace=name,
        device=record.device,
        events=len(trace),
        history_start=len(state.blocks),
        peak_live_bytes=trace.peak_live_bytes,
        scope=scope,
        capacity_bytes=capacity,
        capacity_source=capacity_source,
        gpu_capacity_bytes=trace.capacity,
        recorded=recorded,
        candidates=results,
        recommended={family: _recommend(results, family) for family in ("pytorch", "gpupool")},
        top_sites=sites.at_peak(record.rows, record.frames, start_blocks, TOP_SITES),
        notes=_start_notes(record, state, scope) + recorded_notes + _corrected_notes(results),
    )


def _traced(trace: gtrace.Trace) -> Snapshot:
    """A trace without segments, settings or frames (an RMM CSV's) as a one-device snapshot."""
    rows = [({"free": "free_completed"}.get(e.action, e.action), *e[1:]) for e in trace]
    return Snapshot(trace.name, [DeviceRecord(0, rows, {}, [], {})], None)


def load(source: Any) -> Snapshot:
    """A snapshot from a path (pickle or RMM CSV), a snapshot dict, or a loaded ``gpupool.Trace``."""
    if isinstance(source, gtrace.Trace):
        return _traced(source)
    # A list is torch.cuda.memory_snapshot()'s segments, as trace.from_snapshot reads it.
    if isinstance(source, (dict, list)):
        return snapshot.from_dict(source, "snapshot")
    path = os.fspath(source)
    return snapshot.read(path) if gtrace._is_pickle(path) else _traced(gtrace.load(path))


def advise_each(source: Any, capacity: int | str | None = None, progress: Progress | None = None) -> list[Advice]:
    """The advice for every device of ``source`` (see ``advise``) that has a history or segments."""
    # Advice builds plain data only; a million-event snapshot is millions of objects that the
    # cyclic collector would otherwise walk again and again.
    with gtrace._no_cycle_collection():
        return _advise_each(source, capacity, progress)


def _advise_each(source: Any, capacity: int | str | None, progress: Progress | None) -> list[Advice]:
    limit = _native.parse_capacity(capacity)  # before loading: a bad one fails at once
    loaded = load(source)
    if not loaded.devices:
        raise ValueError(f"{loaded.name}: no device has a history or segments")
    ran = settings.from_recorded(loaded.settings, loaded.shows_expandable)
    return [advise_device(loaded.name, record, ran, limit, progress) for record in loaded.devices]


def advise(source: Any, capacity: int | str | None = None, device: int | None = None) -> Advice:
    """What-if answers for a PyTorch job from its memory snapshot: how closely a replay of the
    recorded settings matches the recorded run, what every stock PyTorch setting and gpupool
    strategy would need, the best of each, and the allocation sites holding the most at the peak.

    ``source`` is a snapshot pickle (``torch.cuda.memory._dump_snapshot``) or RMM CSV path, a
    snapshot dict, or a ``gpupool.Trace``. ``capacity`` (bytes or a size such as ``"80GiB"``)
    adds whether each configuration fits that device. A snapshot of several devices needs
    ``device``; ``advise_each`` advises them all."""
    with gtrace._no_cycle_collection():
        return _advise_one(source, capacity, device)


def _advise_one(source: Any, capacity: int | str | None, device: int | None) -> Advice:
    limit, device = _native.parse_capacity(capacity), gtrace._device_index(device)
    loaded = load(source)
    records = [r for r in loaded.devices if device is None or r.device == device]
    if not records:
        have = [r.device for r in loaded.devices]
        raise ValueError(f"{loaded.name}: no device {device} with a history or segments (devices: {have})")
    if len(records) > 1:
        have = [r.device for r in records]
        raise ValueError(f"{loaded.name}: devices {have} have data; pick one with device=N, or use advise_each")
    ran = settings.from_recorded(loaded.settings, loaded.shows_expandable)
    return advise_device(loaded.name, records[0], ran, limit)
