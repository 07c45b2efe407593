"""The synthesized snapshots are what they claim to be: each shape's history holds its events (an
``empty_cache`` burst per release, a release-and-retry per retry, an ``oom`` at the end), the
expandable ones map pages, and recording starts mid-run with settings PyTorch would record.
Whether ``gpupool advise`` replays them faithfully is not checked here."""

from __future__ import annotations

import functools

import pytest
import synth_snapshots as synth

from gpupool._advice import settings

# Two small sources: one whose least capacity retries, one that must be cut short to retry
# with expandable segments.
SOURCES = [s for s in synth.SOURCES if "medium_128_inference" in s or "bcrafton" in s]
CASES = [(s, e) for s in SOURCES for e in (False, True)]


@functools.cache
def made(source: str, shape: str, expandable: bool) -> synth.Synthesized:
    if not (synth.ROOT / source).exists():
        pytest.skip(f"{source} is absent (the shared snapshots live beside the repository)")
    return synth.synthesized(source, shape, expandable)


def actions(made: synth.Synthesized) -> list[str]:
    return [e["action"] for e in made.snapshot["device_traces"][0]]


@pytest.mark.parametrize(("source", "expandable"), CASES)
def test_empty_cache_leaves_a_burst_per_call_that_released(source, expandable):
    result = made(source, "empty_cache", expandable)
    truth = result.truth
    assert 3 <= truth.empty_cache_calls <= 6 and truth.empty_cache_releases >= 1
    # Nothing else gives memory back on an unlimited device.
    assert len(synth.release_bursts(result.snapshot["device_traces"][0])) == truth.empty_cache_releases
    assert "oom" not in actions(result)
    assert (truth.capacity, truth.retries, truth.ooms) == (None, 0, 0)


@pytest.mark.parametrize(("source", "expandable"), CASES)
def test_oom_retry_releases_then_grows_and_nothing_fails(source, expandable):
    result = made(source, "oom_retry", expandable)
    grow = "segment_map" if expandable else "segment_alloc"
    bursts = synth.release_bursts(result.snapshot["device_traces"][0])
    assert bursts and all(after == grow for _, after in bursts)
    assert len(bursts) == result.truth.retries
    assert "oom" not in actions(result) and result.truth.ooms == 0


@pytest.mark.parametrize(("source", "expandable"), CASES)
def test_oom_ends_with_the_failed_request_and_the_device_free(source, expandable):
    result = made(source, "oom", expandable)
    last = result.snapshot["device_traces"][0][-1]
    assert last["action"] == "oom" and "addr" not in last and last["size"] > 0
    reserved = sum(s["total_size"] for s in result.snapshot["segments"])
    assert last["device_free"] == result.truth.capacity - reserved
    assert actions(result).count("oom") == result.truth.ooms == 1


@pytest.mark.parametrize("shape", synth.SHAPES)
@pytest.mark.parametrize(("source", "expandable"), CASES)
def test_each_run_starts_mid_run_with_the_settings_pytorch_records(source, shape, expandable):
    result = made(source, shape, expandable)
    entries = result.snapshot["device_traces"][0]
    kinds = set(actions(result))
    if expandable:
        assert not kinds & {"segment_alloc", "segment_free"}
    else:
        assert not kinds & {"segment_map", "segment_unmap"}
    # Blocks still live at the snapshot were allocated before its history began.
    allocated = {e["addr"] for e in entries if e["action"] == "alloc"}
    live = {b["address"] for s in result.snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated"}
    assert live - allocated
    read = settings.from_recorded(result.snapshot["allocator_settings"])
    assert (read.env, read.unknown) == (synth.EXPANDABLE_ENV if expandable else "", [])
    assert result.truth.segment_decisions == sum(a.startswith("segment_") for a in actions(result))


def test_the_same_seed_gives_the_same_run():
    source = SOURCES[0]
    first = made(source, "empty_cache", False).truth  # skips where the shared snapshots are absent
    assert synth.ground_truth(source, "empty_cache", seed=0) == first


def test_a_history_whose_memory_only_grows_cannot_retry():
    forward = next(s for s in synth.SOURCES if "ctx128_forward" in s)
    if not (synth.ROOT / forward).exists():
        pytest.skip(f"{forward} is absent")
    with pytest.raises(synth.NoRetry):
        synth.retry_run(forward, False)
