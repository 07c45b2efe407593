"""How faithfully ``gpupool advise`` replays what a job did: on snapshots whose truth is known
(``synth_snapshots``: a ``sim`` pool imitating PyTorch's allocator, with ``empty_cache()`` calls,
out-of-memory releases and retries, or an out-of-memory error it died of) and on the shared real
snapshots with segment events, the replay of what ran stays within 1% of the recorded peak
reserved bytes and makes at least 95% of the recorded segment decisions in order; and every
configuration's min capacity runs the history, while 0.5% less does not."""

from __future__ import annotations

import functools
import warnings

import pytest
import synth_snapshots as synth
from advice_snapshots import shared_names, shared_snapshot

from gpupool import _native
from gpupool._advice import analysis, start
from gpupool._advice.advice import TOLERANCE, Advice

PEAK_WITHIN = 0.01
DECISIONS_AT_LEAST = 0.95
# The shared snapshots whose history records the allocator's own segment decisions.
WITH_DECISIONS = (
    "kkaitlyn111__memory_files_memory_ctx128_forward_.pickle",
    "kkaitlyn111__memory_files_memory_ctx128_fullstep_.pickle",
)


def _case_id(case: tuple[str, str, bool]) -> str:
    source, shape, expandable = case
    name = source.rsplit("/", 1)[-1].removesuffix(".pickle")
    return f"{name}-{shape}-{'expandable' if expandable else 'plain'}"


@functools.cache
def _synthesized(case: tuple[str, str, bool]) -> tuple[synth.Synthesized, Advice]:
    source, shape, expandable = case
    try:
        made = synth.synthesized(source, shape, expandable)
    except synth.NoRetry as why:
        pytest.skip(f"no capacity makes this history release and retry: {why}")
    except FileNotFoundError:
        pytest.skip(f"{source} is absent (the shared snapshots live beside the repository)")
    return made, analysis.advise(made.snapshot)


CASES = synth.all_cases()


def _assert_faithful(advice: Advice) -> None:
    r = advice.recorded
    assert r.peak_reserved_bytes is not None, "the recorded curve is rebuilt from the segment events"
    drift = r.replayed_peak_reserved_bytes / r.peak_reserved_bytes - 1
    assert abs(drift) <= PEAK_WITHIN, f"replayed peak {drift:+.2%} off the recorded one"
    assert r.segment_decisions_matched is not None and r.segment_decisions_matched >= DECISIONS_AT_LEAST, (
        f"{r.segment_decisions_matched} of {r.segment_decisions} decisions in order"
    )


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_the_replay_of_what_ran_matches_a_synthesized_run(case):
    (snapshot, truth), advice = _synthesized(case)
    _, shape, expandable = case
    r = advice.recorded
    if truth.segment_decisions == 0:
        # A run whose peak came before recording began and that died before its next
        # segment decision: nothing to compare with but the GPU and the error.
        assert r.peak_reserved_bytes is None and shape == "oom"
    else:
        assert r.peak_reserved_bytes == truth.peak_reserved_bytes
        _assert_faithful(advice)
    if shape == "empty_cache":
        assert (r.empty_cache_calls, r.oom_releases, r.ooms) == (truth.empty_cache_releases, 0, 0)
        assert advice.gpu_capacity_bytes is None
    elif shape == "oom_retry":
        assert 1 <= r.oom_releases and r.empty_cache_calls + r.oom_releases <= truth.retries
        assert r.ooms == 0
        # gpupool's stand-in for expandable segments best-fits blocks whether their pages are
        # mapped or not, so its out-of-memory path can release a run of pages that would have
        # held the request; PyTorch's never does, and such a burst reads as empty_cache().
        assert expandable or r.empty_cache_calls == 0
    else:
        # The GPU is what the device had: reserved bytes plus free bytes at the error.
        assert advice.gpu_capacity_bytes == truth.capacity
        assert (advice.capacity_bytes, advice.capacity_source) == (truth.capacity, "oom entries")
        assert r.empty_cache_calls == 0
        assert (r.ooms, r.ooms_repeated) == (1, 1), "the recorded error happens again in the replay on that GPU"


@pytest.mark.parametrize("name", WITH_DECISIONS)
def test_the_replay_of_what_ran_matches_the_shared_runs(name):
    advice = analysis.advise(shared_snapshot(name))
    _assert_faithful(advice)
    assert advice.recorded.largest_gap_bytes is not None


def test_the_full_training_step_called_empty_cache_once():
    advice = analysis.advise(shared_snapshot("kkaitlyn111__memory_files_memory_ctx128_fullstep_.pickle"))
    r = advice.recorded
    assert (r.empty_cache_calls, r.oom_releases, r.ooms) == (1, 0, 0)
    assert r.segment_decisions_matched == 1.0


def _runs_on(advice: Advice, snapshot, capacities: dict[str, int]) -> dict[str, bool]:
    """Whether each candidate named in ``capacities`` replays on its capacity with no more
    failures than on an unlimited device (requests beyond any device, or beyond the GPU the
    job had, fail everywhere). The replays are set up as advise sets them up."""
    loaded = analysis.load(snapshot)
    record = next(d for d in loaded.devices if d.device == advice.device)
    state = start.starting_state(record.rows, record.segments)
    before = [(b.address, b.requested, b.stream) for b in state.blocks]
    final = sum(s.size for s in record.segments)
    trace = _native.Trace.from_snapshot_entries("check", record.rows, before, final)
    segments = [(s.address, s.size, s.small, s.stream) for s in state.segments]
    options = {c.env: c for c in analysis._candidates.candidates(advice.recorded.config)}
    runs = {}
    for c in advice.candidates:
        if c.label not in capacities:
            continue
        option = options[c.config]
        job = "as_run" if option.as_run else "honour"

        def replay(on: int | None, option=option, job=job):
            if option.seeded:
                return _native.replay_from_start(trace, option.config, segments, capacity=on, job=job)[0]
            return _native.replay(trace, option.config, on, job=job)

        runs[c.label] = replay(capacities[c.label]).ooms <= replay(None).ooms
    return runs


def _check_min_capacities(advice: Advice, snapshot) -> None:
    needs = {c.label: c.min_capacity_bytes for c in advice.candidates if c.min_capacity_bytes is not None}
    assert needs, "some configuration runs the history"
    at = _runs_on(advice, snapshot, needs)
    below = _runs_on(advice, snapshot, {label: int(need * (1 - TOLERANCE)) for label, need in needs.items()})
    for label in needs:
        assert at[label], f"{label}: an out-of-memory error on its min capacity"
        assert not below[label], f"{label}: runs {TOLERANCE:.1%} below its min capacity too"


@pytest.mark.parametrize("name", shared_names())
def test_every_min_capacity_holds_on_the_shared_runs(name):
    path = shared_snapshot(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for advice in analysis.advise_each(path):
            _check_min_capacities(advice, path)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_min_capacity_holds_on_a_synthesized_run(case):
    (snapshot, _), advice = _synthesized(case)
    _check_min_capacities(advice, snapshot)
