"""``gpupool advise`` on real snapshots: it runs on each, its figures agree with the file, the
replay of the recorded settings matches the recorded run, and every recommendation holds."""

from __future__ import annotations

import pytest
from advice_snapshots import SEGMENTS_ONLY, WITH_SEGMENT_EVENTS, shared_names, shared_snapshot

import gpupool
from gpupool import _native
from gpupool import trace as gtrace
from gpupool._advice import sites, snapshot, start
from gpupool._advice.table import report

GiB = 1 << 30


def advise_all(name: str) -> list[gpupool.Advice]:
    return gpupool.advise_each(shared_snapshot(name))


def independent_figures(name: str) -> dict[int, dict[str, int]]:
    """Per device, straight from the pickle: reserved and live bytes at the end, and the most
    requested bytes live at once (blocks live before recording counted from the start)."""
    raw = gtrace._read_pickle(shared_snapshot(name))
    figures: dict[int, dict[str, int]] = {}
    for s in raw["segments"]:
        f = figures.setdefault(s.get("device", 0), {"reserved": 0, "live": 0})
        f["reserved"] += s["total_size"]
        f["live"] += sum(b["requested_size"] for b in s["blocks"] if b["state"].startswith("active"))
    for device, entries in enumerate(raw["device_traces"]):
        f = figures.setdefault(device, {"reserved": 0, "live": 0})
        first_free = {}
        for e in entries:
            if e["action"] in ("alloc", "free_completed"):
                first_free.setdefault(e["addr"], e)
        touched = set(first_free)
        live = sum(e["size"] for e in first_free.values() if e["action"] == "free_completed")
        live += sum(
            b["requested_size"]
            for s in raw["segments"]
            if s.get("device", 0) == device
            for b in s["blocks"]
            if b["state"].startswith("active") and b.get("address") not in touched
        )
        sizes, peak = {}, live
        for e in entries:
            if e["action"] == "alloc":
                sizes[e["addr"]] = e["size"]
                live += e["size"]
                peak = max(peak, live)
            elif e["action"] == "free_completed":
                live -= sizes.pop(e["addr"], None) or first_free[e["addr"]]["size"]
        f["peak_live"] = peak
    return figures


@pytest.mark.parametrize("name", shared_names())
def test_every_shared_snapshot_gets_advice_that_agrees_with_the_file(name):
    figures = independent_figures(name)
    for advice in advise_all(name):
        truth = figures[advice.device]
        assert advice.peak_live_bytes == truth["peak_live"]
        assert advice.recorded.peak_reserved_bytes is None or advice.recorded.segment_decisions > 0
        families = {c.family for c in advice.candidates}
        assert families == {"pytorch", "gpupool"}
        # Nothing holds the job in less than its peak live bytes.
        assert all(c.min_capacity_bytes >= advice.peak_live_bytes for c in advice.candidates)
        assert all(c.fragmentation_bytes == c.peak_reserved_bytes - advice.peak_live_bytes for c in advice.candidates)
        pytorch = advice.recommended["pytorch"]
        assert pytorch.saved_bytes >= 0, "the recommended PyTorch setting needs more than what ran"
        assert pytorch.min_capacity_bytes == advice.as_run.min_capacity_bytes - pytorch.saved_bytes
        text = report(advice)
        assert max(len(line) for line in text.splitlines()) <= 100
        assert pytorch.env.split("=")[0] in text and advice.recommended["gpupool"].env in text
        if name in SEGMENTS_ONLY:
            assert advice.scope == "segments"
            assert advice.recorded.start_reserved_bytes == truth["reserved"]
            assert "cannot be answered" in text
            # Replayed from the recorded segments, the job holds what it held: the live blocks.
            assert advice.as_run.peak_reserved_bytes == truth["reserved"]
        else:
            assert advice.scope == "history"


@pytest.mark.parametrize("name", shared_names())
def test_the_sites_at_the_peak_hold_the_peak_live_bytes(name):
    # Every block live at the peak is some site's, those live before recording (and freed
    # during it) included: the sites add up to the file's own peak.
    figures = independent_figures(name)
    for record in snapshot.read(shared_snapshot(name)).devices:
        state = start.starting_state(record.rows, record.segments)
        held = sites.at_peak(record.rows, record.frames, [(b.address, b.requested, ()) for b in state.blocks], 10**9)
        assert sum(size for _, size in held) == figures[record.device]["peak_live"]


def test_the_replay_of_the_recorded_settings_matches_the_recorded_run():
    [advice] = advise_all(WITH_SEGMENT_EVENTS)
    recorded = advice.recorded
    # The file only grows segments: its recorded peak is every final segment.
    assert recorded.peak_reserved_bytes == independent_figures(WITH_SEGMENT_EVENTS)[0]["reserved"]
    drift = abs(recorded.replayed_peak_reserved_bytes / recorded.peak_reserved_bytes - 1)
    assert drift <= 0.02
    assert recorded.segment_decisions == 289
    assert recorded.segment_decisions_matched >= 0.95
    assert recorded.replayed_from == "recorded start"


def _rebuild(name: str, device: int = 0):
    """The trace and start state ``advise`` replays, rebuilt the same way."""
    record = next(r for r in snapshot.read(shared_snapshot(name)).devices if r.device == device)
    state = start.starting_state(record.rows, record.segments)
    before = [(b.address, b.requested, b.stream) for b in state.blocks]
    trace = _native.Trace.from_snapshot_entries(name, record.rows, before)
    return trace, [(s.address, s.size, s.small, s.stream) for s in state.segments]


@pytest.mark.parametrize("name", shared_names())
def test_every_recommendation_runs_at_its_minimum_capacity(name):
    trace, segments = _rebuild(name)
    [advice] = advise_all(name)
    for recommendation in advice.recommended.values():
        chosen = next(c for c in advice.candidates if c.config == recommendation.config)
        capacity = recommendation.min_capacity_bytes
        if chosen.gpupool_config.startswith("strategy:pytorch"):
            result, _, _ = _native.replay_from_start(trace, chosen.gpupool_config, segments, capacity=capacity)
            below, _, _ = _native.replay_from_start(
                trace, chosen.gpupool_config, segments, capacity=capacity * 99 // 100
            )
        else:
            result = _native.replay(trace, chosen.gpupool_config, capacity)
            below = _native.replay(trace, chosen.gpupool_config, capacity * 99 // 100)
        assert result.ooms == 0, recommendation
        assert below.ooms > 0, f"{recommendation}: 1% less also fits, so it is not the minimum"


def test_a_costly_recorded_setting_is_beaten_and_explained(tmp_path):
    raw = gtrace._read_pickle(shared_snapshot(WITH_SEGMENT_EVENTS))
    raw["allocator_settings"]["roundup_power2_divisions"] = {str(1 << i): 2 for i in range(16)}
    raw["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] = (
        "pinned_num_register_threads:8,release_lock_on_cudamalloc:True"
    )
    advice = gpupool.advise(raw, capacity="20GiB")
    assert advice.recorded.config.startswith(
        "pinned_num_register_threads:8,release_lock_on_cudamalloc:True,roundup_power2_divisions:[1:2,2:2,"
    )
    pytorch = advice.recommended["pytorch"]
    assert pytorch.saved_bytes > GiB and pytorch.config != advice.recorded.config
    assert advice.as_run.fits is False and advice.as_run.headroom_bytes < 0
    assert "release_lock_on_cudamalloc" in advice.recorded.inert_keys
    assert any("without effect on device memory" in note for note in advice.notes)


def test_json_has_the_issue_schema(capsys):
    from gpupool import cli

    assert cli.main(["advise", str(shared_snapshot(WITH_SEGMENT_EVENTS)), "--json", "--capacity", "20GiB"]) == 0
    import json

    [obj] = json.loads(capsys.readouterr().out)
    assert {"trace", "events", "peak_live_bytes", "recorded", "candidates", "recommended", "top_sites"} <= set(obj)
    assert {"config", "peak_reserved_bytes", "replayed_peak_reserved_bytes", "segment_decisions_matched"} <= set(
        obj["recorded"]
    )
    keys = {"config", "family", "peak_reserved_bytes", "min_capacity_bytes", "fragmentation_bytes", "driver_calls"}
    for candidate in obj["candidates"]:
        assert keys | {"fits"} <= set(candidate)
        assert candidate["family"] in ("pytorch", "gpupool") and isinstance(candidate["fits"], bool)
    for family in ("pytorch", "gpupool"):
        assert {"config", "env", "min_capacity_bytes", "saved_bytes"} <= set(obj["recommended"][family])
    assert obj["top_sites"] and {"frame", "bytes_at_peak"} == set(obj["top_sites"][0])
    assert obj["top_sites"][1]["frame"].endswith("(forward)")


def test_the_table_says_what_it_measured():
    [advice] = advise_all(WITH_SEGMENT_EVENTS)
    text = report(advice)
    assert "peak reserved: recorded 18.32 GiB, replayed 18.32 GiB (+0.0%)" in text
    assert "segment decisions reproduced in order: 289 of 289 recorded" in text
    assert "Recording began mid-run: 324 blocks" in text


def test_a_recommendation_that_needs_more_says_so():
    import dataclasses

    [advice] = advise_all(WITH_SEGMENT_EVENTS)
    worse = dataclasses.replace(advice.recommended["gpupool"], saved_bytes=-GiB // 4, saved_fraction=-0.0136)
    advice.recommended["gpupool"] = worse
    assert "needs 0.25 GiB (1.4%) more than what you ran" in report(advice)


def candidate(config: str, needs: int | None, calls: int, family: str = "gpupool", as_run: bool = False):
    from gpupool._advice.advice import CandidateResult

    return CandidateResult(
        config=config,
        family=family,
        gpupool_config=config,
        as_run=as_run,
        peak_reserved_bytes=needs or 0,
        min_capacity_corrected=False,
        min_capacity_bytes=needs,
        fragmentation_bytes=0,
        driver_calls=calls,
        fits=None,
        headroom_bytes=None,
        timeline=([], [], []),
    )


@pytest.mark.parametrize(
    ("pages_needs", "default_needs", "bfc_needs", "expected"),
    [
        (9_980, 10_000, 10_300, "strategy:default"),  # 0.2% less: within the search's 0.5%, at 12 times the calls
        (9_900, 10_000, 10_300, "strategy:pages"),  # 1% less: a saving
        (9_980, None, 10_300, "strategy:pages"),  # the default fits no size tried
        (None, None, 10_300, "strategy:bfc"),
        (None, None, None, "strategy:default"),  # nothing fits: no saving to prefer another for
    ],
)
def test_gpupool_strategies_replace_the_default_only_past_the_search_tolerance(
    pages_needs, default_needs, bfc_needs, expected
):
    from gpupool._advice.analysis import _recommend

    MiB = 1 << 20
    mib = lambda n: None if n is None else n * MiB  # noqa: E731
    results = [
        candidate("expandable_segments:False", mib(10_400), 30, family="pytorch", as_run=True),
        candidate("strategy:default", mib(default_needs), 500),
        candidate("strategy:pages", mib(pages_needs), 6_000),
        candidate("strategy:bfc", mib(bfc_needs), 5),
    ]
    recommended = _recommend(results, "gpupool")
    assert recommended.config == expected
    chosen = next(r for r in results if r.config == expected)
    assert recommended.min_capacity_bytes == chosen.min_capacity_bytes
    assert recommended.env == f"GPUPOOL_ALLOC_CONF={expected}"
    if chosen.min_capacity_bytes is not None:
        assert recommended.saved_bytes == mib(10_400) - chosen.min_capacity_bytes
