"""What a job did to its own pool, as traces carry it: ``empty_cache()`` calls and the
out-of-memory path's releases become events when a snapshot is loaded, the GPU's size comes from
``oom`` entries, replays repeat them unless told not to, and RMM's CSV leaves them out with a
warning."""

from __future__ import annotations

import json
import pickle
import warnings

import pytest
import synth_snapshots as synth
from advice_snapshots import BASE, MiB, entry, shared_snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

import gpupool
from gpupool import cli
from gpupool import trace as gtrace

FULLSTEP = "kkaitlyn111__memory_files_memory_ctx128_fullstep_.pickle"


def _synthesized_empty_cache() -> synth.Synthesized:
    source = synth.SOURCES[0]
    if not (synth.ROOT / source).exists():
        pytest.skip(f"{source} is absent (the shared snapshots live beside the repository)")
    return synth.synthesized(source, "empty_cache")


def _actions(trace: gtrace.Trace) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in trace:
        counts[e.action] = counts.get(e.action, 0) + 1
    return counts


def test_a_burst_of_segment_frees_becomes_one_empty_cache_event():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace = gtrace.load(shared_snapshot(FULLSTEP))
    releases = [e for e in trace if e.action in ("empty_cache", "oom_release")]
    # Recording began with 430 segment_free entries in a row: one call, 29,486 MiB given back.
    assert [(e.action, e.size // MiB) for e in releases] == [("empty_cache", 29486)]
    assert trace.capacity is None, "no oom entry: the GPU's size is unknown"


def test_an_oom_entry_gives_the_gpu_and_its_burst_the_out_of_memory_path():
    segment = 20 * MiB
    entries = [
        entry("segment_alloc", BASE, segment),
        entry("alloc", BASE, 6 * MiB),
        entry("segment_alloc", BASE + segment, segment),
        entry("alloc", BASE + segment, 12 * MiB),
        entry("free_completed", BASE + segment, 12 * MiB),
        entry("segment_free", BASE + segment, segment),
        {"action": "oom", "device_free": 25 * MiB, "size": 30 * MiB, "stream": 0, "time_us": 9},
    ]
    segments = [{"address": BASE, "total_size": segment, "stream": 0, "segment_type": "large", "blocks": []}]
    trace = gtrace.from_snapshot({"device_traces": [entries], "segments": segments})
    assert [e.action for e in trace] == ["alloc", "alloc", "free", "oom_release", "oom"]
    assert trace.capacity == segment + 25 * MiB
    # On that GPU the request fails again; without the job's actions it is skipped.
    honoured = gpupool.replay(trace, "strategy:pytorch", capacity=trace.capacity)
    assert (honoured.ooms, honoured.ooms_as_recorded) == (1, 1)
    ignored = gpupool.replay(trace, "strategy:pytorch", capacity=trace.capacity, honour_job=False)
    assert (ignored.ooms, ignored.releases) == (0, 0)
    # Unlimited, the retried request is served: the min capacity holds it beside the live block.
    needs = gpupool.replay(trace, "strategy:pytorch", min_capacity=True).min_capacity_bytes
    assert needs >= 6 * MiB + 30 * MiB
    # A request beyond the whole GPU is refused untried, everywhere, and weighs on no capacity.
    beyond = [*entries[:-1], {**entries[-1], "size": 64 * MiB}]
    trace = gtrace.from_snapshot({"device_traces": [beyond], "segments": segments})
    result = gpupool.replay(trace, "strategy:pytorch", min_capacity=True)
    assert (result.ooms, result.ooms_as_recorded) == (1, 1)
    assert result.min_capacity_bytes < 6 * MiB + 30 * MiB


def test_a_replay_repeats_empty_cache_unless_told_not_to():
    made = _synthesized_empty_cache()
    trace = gtrace.from_snapshot(made.snapshot)
    calls = _actions(trace).get("empty_cache", 0)
    assert calls == made.truth.empty_cache_releases >= 1
    honoured = gpupool.replay(trace, "strategy:pytorch")
    ignored = gpupool.replay(trace, "strategy:pytorch", honour_job=False)
    assert (honoured.releases, ignored.releases) == (calls, 0)
    # Releases give memory back: the pool holding it throughout never reserves less at its peak.
    assert ignored.peak_reserved_bytes >= honoured.peak_reserved_bytes
    assert ignored.device_calls < honoured.device_calls


def test_the_replay_command_takes_the_switch(capsys, tmp_path):
    made = _synthesized_empty_cache()
    path = tmp_path / "job.pickle"
    path.write_bytes(pickle.dumps(made.snapshot))
    for flag, expect in (([], made.truth.empty_cache_releases), (["--ignore-job"], 0)):
        cli.main(["replay", str(path), "--json", *flag])
        [row] = json.loads(capsys.readouterr().out)
        assert row["releases"] == expect


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 24), st.booleans()), min_size=1, max_size=40))
def test_a_pools_own_history_round_trips_its_releases(program):
    """A pool's history read back as a trace holds one release for each call that gave memory
    back, with the bytes it gave. Which kind each is read as follows from what comes after it
    (rust/trace/job.rs); a replay of the configuration that ran repeats both kinds."""
    pool = gpupool.Pool("sim", capacity="1GiB", config="strategy:pytorch")
    pool.record_history()
    live, released = [], []
    for mib, flush in program:
        live.append(pool.alloc(mib * MiB))
        if flush:
            live.pop(0).free()
            before = pool.memory_reserved()
            pool.empty_cache()
            released.append(before - pool.memory_reserved())
    trace = gtrace.from_snapshot(pool.snapshot())
    assert [e.size for e in trace if e.action in ("empty_cache", "oom_release")] == [r for r in released if r]
    for ptr in live:
        ptr.free()


def test_rmm_csv_leaves_the_releases_out_and_warns(tmp_path):
    pool = gpupool.Pool("sim", capacity="1GiB", config="strategy:pytorch")
    pool.record_history()
    pool.alloc(30 * MiB).free()
    pool.empty_cache()
    pool.alloc(4 * MiB).free()
    path = tmp_path / "log.csv"
    with pytest.warns(UserWarning, match="1 release of cached memory left out"):
        pool.dump_trace(path)
    assert [e.action for e in gtrace.load(path)] == ["alloc", "free", "alloc", "free"]


@pytest.mark.parametrize("release", ["empty_cache", "watermark"])
def test_a_released_segment_is_recorded_on_its_own_stream(release):
    """PyTorch records a segment_free on the stream the segment was made for: the release bursts
    that advise reads are told apart by it."""
    config = "strategy:pytorch" + (",release_threshold:0" if release == "watermark" else "")
    pool = gpupool.Pool("sim", capacity="1GiB", config=config)
    pool.record_history()
    side = pool.stream()
    pool.alloc(30 * MiB, side).free()
    side.synchronize()
    pool.empty_cache()
    entries = pool.snapshot()["device_traces"][0]
    made = [e["stream"] for e in entries if e["action"] == "segment_alloc"]
    freed = [e["stream"] for e in entries if e["action"] == "segment_free"]
    assert made == freed == [side.id]


@pytest.mark.parametrize("state", [{}, ["active_allocated"], None, 7])
def test_a_block_state_of_any_type_reads_as_not_live(state):
    """A damaged snapshot may hold anything where a block's state goes, an unhashable value too:
    the block is then not live, for the trace reader and for advise alike."""
    live = {"address": BASE, "size": 2 * MiB, "requested_size": 2 * MiB, "state": "active_allocated"}
    odd = {"address": BASE + 2 * MiB, "size": 2 * MiB, "requested_size": 2 * MiB, "state": state}
    segment = {"address": BASE, "total_size": 4 * MiB, "stream": 0, "segment_type": "large", "blocks": [live, odd]}
    snapshot = {"segments": [segment], "device_traces": [[]]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert gtrace.from_snapshot(snapshot).peak_live_bytes == 2 * MiB
        assert gpupool.advise(snapshot).peak_live_bytes == 2 * MiB
