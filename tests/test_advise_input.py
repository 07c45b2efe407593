"""``gpupool advise`` on the snapshots users have: several devices, no ``time_us``, no
settings, histories that start mid-run, ``oom`` entries, damaged or hostile files, CSVs; the
progress bar shows only on a terminal."""

from __future__ import annotations

import json
import os
import pickle
import pty
import subprocess
import sys

import pytest
import test_trace
from advice_snapshots import BASE, MiB, block, entry, segment, warmed_up, write, write_deeply_nested
from hypothesis import given
from hypothesis import strategies as st

import gpupool
from gpupool import cli
from gpupool._advice import settings, sites
from gpupool._advice.table import _Units


def test_a_warmed_up_job_replays_from_where_recording_began(tmp_path):
    entries, segments = warmed_up()
    settings_ = {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "expandable_segments": False}
    path = write(tmp_path, {"device_traces": [entries], "segments": segments, "allocator_settings": settings_})
    advice = gpupool.advise(path)
    recorded = advice.recorded
    # 64 MiB cached at the start, 24 MiB grown: the replay makes the same single decision.
    assert (recorded.start_reserved_bytes, recorded.peak_reserved_bytes) == (64 * MiB, 88 * MiB)
    assert (recorded.replayed_peak_reserved_bytes, recorded.segment_decisions_matched) == (88 * MiB, 1.0)
    # The 4 MiB block freed in the history was live at its start.
    assert advice.peak_live_bytes == 4 * MiB + 40 * MiB + 24 * MiB - 4 * MiB
    assert advice.top_sites[0] == ("train.py:7 (step)", 40 * MiB)
    assert any("Recording began mid-run: 1 blocks" in note for note in advice.notes)


def test_a_device_holding_only_cached_segments_beside_a_recorded_one_is_not_advised(tmp_path):
    # cuda:1 ran before recording began and left only free blocks in its cache: nothing to
    # replay, as `gpupool.trace.load_each` reads it too.
    entries, segments = warmed_up(0)
    cached = segment(BASE + (1 << 40), 2 * MiB, [block(BASE + (1 << 40), 2 * MiB, 0, "inactive")], device=1)
    path = write(tmp_path, {"device_traces": [entries, []], "segments": segments + [cached]})
    assert [a.device for a in gpupool.advise_each(path)] == [0]
    assert len(gpupool.trace.load_each(path)) == 1
    assert gpupool.advise(path).device == 0
    with pytest.raises(ValueError, match=r"no device 1 with a history or segments \(devices: \[0\]\)"):
        gpupool.advise(path, device=1)
    # With live blocks in it, cuda:1 is read by both.
    cached["blocks"][0]["state"] = "active_allocated"
    path = write(tmp_path, {"device_traces": [entries, []], "segments": segments + [cached]})
    assert [a.device for a in gpupool.advise_each(path)] == [0, 1]
    assert len(gpupool.trace.load_each(path)) == 2


def test_several_devices_are_each_advised(tmp_path, capsys):
    first, second = warmed_up(0), warmed_up(1)
    path = write(tmp_path, {"device_traces": [first[0], second[0]], "segments": first[1] + second[1]})
    assert [a.device for a in gpupool.advise_each(path)] == [0, 1]
    with pytest.raises(ValueError, match=r"devices \[0, 1\] have data; pick one"):
        gpupool.advise(path)
    assert gpupool.advise(path, device=1).device == 1
    # True == 1 in Python: it must not pick device 1.
    with pytest.raises(TypeError, match="device must be an int, got True"):
        gpupool.advise(path, device=True)
    assert cli.main(["advise", str(path)]) == 0
    out = capsys.readouterr().out
    assert "job.pickle, device 0" in out and "job.pickle, device 1" in out


def test_no_time_us_and_no_settings_are_fine(tmp_path):
    entries, segments = warmed_up(time_us=False)
    assert all("time_us" not in e for e in entries)
    advice = gpupool.advise(write(tmp_path, {"device_traces": [entries], "segments": segments}))
    assert advice.recorded.segment_decisions_matched == 1.0
    assert not advice.recorded.settings_recorded
    assert any("PyTorch's defaults are assumed" in note for note in advice.notes)


def test_oom_entries_and_unknown_actions_are_reported_not_fatal(tmp_path):
    entries, segments = warmed_up()
    entries.append({"action": "oom", "device_free": 3 * MiB, "size": 1 << 40, "stream": 0, "time_us": 9})
    entries.append({"action": "cudagraph_replay", "addr": 0, "size": 0, "stream": 0})
    advice = gpupool.advise(write(tmp_path, {"device_traces": [entries], "segments": segments}))
    assert any("hit 1 out-of-memory errors" in note for note in advice.notes)
    assert any("Skipped 1 'cudagraph_replay' entries" in note for note in advice.notes)
    # A request beyond the whole GPU the job had (reserved at the oom plus 3 MiB free) fails on
    # every configuration: it weighs on no capacity, and the replay on that GPU repeats it.
    assert advice.gpu_capacity_bytes is not None and advice.gpu_capacity_bytes < 1 << 30
    assert advice.as_run.min_capacity_bytes < 1 << 30, "the failure beyond the GPU is not counted against it"
    assert (advice.recorded.ooms, advice.recorded.ooms_repeated) == (1, 1)


def test_a_history_no_device_can_serve_fits_no_capacity(tmp_path, capsys):
    # Requests beyond what any device holds (4 EiB) fail in every replay; the search lets such
    # failures be, and advised a device of 0 GiB that "saves 100%".
    huge, huger = (1 << 62) + 1, 1 << 63
    entries = [
        entry("alloc", BASE, huge, 1),
        entry("free_requested", BASE, huge, 2),
        entry("free_completed", BASE, huge, 3),
        entry("alloc", BASE + (1 << 30), huger, 4),
    ]
    path = write(tmp_path, {"device_traces": [entries], "segments": []})
    advice = gpupool.advise(path)
    assert [c.config for c in advice.candidates if c.min_capacity_bytes is not None] == []
    assert all(r.min_capacity_bytes is None for r in advice.recommended.values())
    assert cli.main(["advise", str(path)]) == 0
    answer = capsys.readouterr().out.split("Answer")[1]
    assert answer.count("fits no device size gpupool tried") == 2 and "saves" not in answer, answer


def test_expandable_runs_and_graph_pools_are_said_to_be_approximated(tmp_path):
    entries, segments = warmed_up()
    segments[1]["segment_pool_id"] = (1, 0)
    recorded = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "expandable_segments": True}
    advice = gpupool.advise(
        write(tmp_path, {"device_traces": [entries], "segments": segments, "allocator_settings": recorded})
    )
    assert advice.as_run.gpupool_config.startswith("strategy:expandable")
    # PyTorch's expandable segments replay from the pages the job had mapped, as plain ones do.
    assert advice.recorded.replayed_from == "recorded start" and advice.recorded.segment_decisions_matched is not None
    assert not any("replayed from their live blocks" in note for note in advice.notes)
    assert any("1 segments (0.02 GiB) belong to private pools" in note for note in advice.notes)


def expandable_job() -> tuple[list[dict], list[dict]]:
    """Recorded after warm-up with 40 MiB of an expandable segment mapped; the history maps 20
    MiB more for a 45 MiB tensor, frees it, and empty_cache unmaps the 40 MiB past the 10 MiB
    block still held. Returns (entries, final segments)."""
    at = 1 << 30
    entries = [
        entry("segment_map", at + 40 * MiB, 20 * MiB, 1),
        entry("alloc", at + 10 * MiB, 45 * MiB, 2),
        entry("free_requested", at + 10 * MiB, 45 * MiB, 3),
        entry("free_completed", at + 10 * MiB, 45 * MiB, 4),
        entry("segment_unmap", at + 20 * MiB, 40 * MiB, 5),
    ]
    final = segment(at, 20 * MiB, [block(at, 10 * MiB, 10 * MiB, LIVE), block(at + 10 * MiB, 10 * MiB, 0, "inactive")])
    final["is_expandable"] = True
    return entries, [final]


def test_an_expandable_segment_is_rebuilt_from_its_maps_and_unmaps(tmp_path):
    entries, segments = expandable_job()
    recorded = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "expandable_segments": True}
    snapshot = {"device_traces": [entries], "segments": segments, "allocator_settings": recorded}
    advice = gpupool.advise(write(tmp_path, snapshot))
    assert (advice.recorded.start_reserved_bytes, advice.recorded.peak_reserved_bytes) == (40 * MiB, 60 * MiB)
    assert not any("outside every segment" in note for note in advice.notes)
    # From the 40 MiB mapped at the start, the 45 MiB tensor maps one 20 MiB page more, and
    # empty_cache() unmaps the two free pages in one call: as recorded.
    assert advice.recorded.replayed_peak_reserved_bytes == 60 * MiB
    assert (advice.recorded.segment_decisions_matched, advice.recorded.empty_cache_calls) == (1.0, 1)


@pytest.mark.parametrize("sign", ["is_expandable", "segment_map"])
def test_expandable_segments_are_seen_where_no_settings_were_recorded(tmp_path, sign):
    # Older PyTorch recorded no allocator settings, expandable segments or not.
    entries, segments = expandable_job()
    if sign == "is_expandable":
        entries = [e for e in entries if e["action"] not in ("segment_map", "segment_unmap")]
    else:
        segments[0]["is_expandable"] = False
    advice = gpupool.advise(write(tmp_path, {"device_traces": [entries], "segments": segments}))
    assert advice.as_run.gpupool_config.startswith("strategy:expandable")
    assert any("defaults are assumed, with the expandable segments its segments show" in n for n in advice.notes)


def test_a_recorded_setting_that_fits_no_capacity_is_advised_against(tmp_path, capsys):
    # A memory fraction this small needs a device 100,000 times the peak: the search gives up,
    # and replay results say so with None, which advice compared with numbers and crashed on.
    entries, segments = warmed_up()
    recorded = {"PYTORCH_ALLOC_CONF": "per_process_memory_fraction:0.00001", "expandable_segments": False}
    path = write(tmp_path, {"device_traces": [entries], "segments": segments, "allocator_settings": recorded})
    advice = gpupool.advise(path, capacity="80GiB")
    assert advice.as_run.min_capacity_bytes is None and advice.as_run.fits is False
    assert advice.as_run.headroom_bytes is None
    for family in ("pytorch", "gpupool"):
        r = advice.recommended[family]
        assert r.min_capacity_bytes is not None and r.min_capacity_bytes < 1 << 30, family
        assert r.saved_bytes is None and r.saved_fraction is None, family
    assert cli.main(["advise", str(path), "--capacity", "80GiB", "--html", str(tmp_path / "r.html")]) == 0
    assert "what you ran fits no device size gpupool tried" in capsys.readouterr().out
    assert "what you ran fits no device size gpupool tried" in (tmp_path / "r.html").read_text()
    assert cli.main(["advise", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["recommended"]["pytorch"]["saved_bytes"] is None


def test_a_csv_and_a_loaded_trace_are_advised_too(tmp_path):
    csv = tmp_path / "job.csv"
    csv.write_text(
        "Thread,Time,Action,Pointer,Size,Stream\n"
        f"0,0,allocate,0x1000,{8 * MiB},0x0\n0,1,allocate,0x2000,{8 * MiB},0x0\n"
        f"0,2,free,0x1000,{8 * MiB},0x0\n0,3,allocate,0x3000,{12 * MiB},0x0\n"
    )
    from_path = gpupool.advise(csv)
    from_trace = gpupool.advise(gpupool.trace.load(csv))
    assert from_path.peak_live_bytes == from_trace.peak_live_bytes == 20 * MiB
    assert from_path.recorded.replayed_from == "recorded start" and from_path.recorded.start_reserved_bytes == 0
    assert from_path.top_sites == [("(no Python frame recorded)", 20 * MiB)]


def test_a_report_that_cannot_be_written_exits_with_a_message(tmp_path, capsys):
    csv = tmp_path / "job.csv"
    csv.write_text(f"Thread,Time,Action,Pointer,Size,Stream\n0,0,allocate,0x1000,{8 * MiB},0x0\n")
    report = tmp_path / "missing" / "report.html"
    with pytest.raises(SystemExit, match=r"gpupool advise: cannot write .*report\.html: .*No such file"):
        cli.main(["advise", str(csv), "--html", str(report)])
    assert "job.csv" in capsys.readouterr().out, "the report printed before the page was written"


class Exploit:
    """Unpickling this would run a shell command."""

    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_damaged_and_hostile_files_are_errors_naming_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    hostile = write(tmp_path, {"device_traces": [[Exploit()]], "segments": []}, "hostile.pickle")
    truncated = tmp_path / "truncated.pickle"
    truncated.write_bytes(pickle.dumps({"device_traces": [[entry("alloc", 1, 512)]], "segments": []})[:-9])
    wrong = write(tmp_path, {"device_traces": [[{"action": "alloc", "addr": "x", "size": 1}]]}, "wrong.pickle")
    unhashable = write(tmp_path, {"device_traces": [[{"action": ["alloc"], "addr": 1, "size": 1}]]}, "list.pickle")
    empty = write(tmp_path, {"device_traces": [], "segments": []}, "empty.pickle")
    for path, why in [
        (hostile, "only plain dicts, lists, strings and numbers are read"),
        (truncated, "not a readable PyTorch memory snapshot"),
        (wrong, "'addr' must be a non-negative int"),
        (unhashable, "expected a dict with an 'action'"),
        (empty, "no device has a history or segments"),
        (tmp_path / "missing.pickle", "No such file"),
    ]:
        with pytest.raises(SystemExit) as error:
            cli.main(["advise", str(path)])
        assert str(path.name) in str(error.value) and why in str(error.value)
    assert not (tmp_path / "pwned").exists()


DEEP_PLACES = {
    "entry": ({"device_traces": [["DEEP"]]}, r"device_traces\[0\], entry 0: expected a dict"),
    "entry addr": (
        {"device_traces": [[entry("alloc", 0, 8) | {"addr": "DEEP"}]]},
        r"device_traces\[0\], entry 0: 'addr' must be",
    ),
    "segment": ({"device_traces": [], "segments": ["DEEP"]}, r"segment 0: expected a dict"),
    "block": (
        {"device_traces": [], "segments": [{"address": 0, "total_size": 8, "blocks": ["DEEP"]}]},
        r"segment 0, block 0: expected a dict",
    ),
}


@pytest.mark.parametrize("place", list(DEEP_PLACES))
def test_a_deeply_nested_value_is_named_without_recursing(tmp_path, place):
    snapshot, message = DEEP_PLACES[place]
    with pytest.raises(ValueError, match=rf"deep\.pickle, {message}.* got \[\[\[\["):
        gpupool.advise(write_deeply_nested(tmp_path, snapshot))


LIVE = "active_allocated"
# Values the native side holds in 64 bits: beyond them, OverflowError tracebacks came instead.
OUT_OF_RANGE = {
    "entry addr": ([entry("alloc", 2**64, 8)], [], r"device_traces\[0\], entry 0: 'addr'"),
    "entry time_us": ([entry("alloc", MiB, 8, time_us=10**400)], [], r"entry 0: 'time_us' must be a finite"),
    "segment address": ([], [segment(2**64, MiB, [])], r"segment 0: 'address'"),
    "segment total_size": ([], [segment(0, 2**64, [])], r"segment 0: 'total_size'"),
    "block requested_size": ([], [segment(0, MiB, [block(0, MiB, 2**64, LIVE)])], r"block 0: 'requested_size'"),
}


@pytest.mark.parametrize("case", list(OUT_OF_RANGE))
def test_values_beyond_64_bits_exit_with_a_message_naming_the_field(tmp_path, case):
    entries, segments, message = OUT_OF_RANGE[case]
    path = write(tmp_path, {"device_traces": [entries], "segments": segments})
    with pytest.raises(SystemExit, match=rf"job\.pickle, .*{message}"):
        cli.main(["advise", str(path)])


def frameless(place: str) -> dict:
    """A snapshot whose one allocation records a number where its stack frames belong."""
    if place == "entry":
        entries, segments = warmed_up()
        entries[0]["frames"] = 5
        return {"device_traces": [entries], "segments": segments}
    held = block(0, MiB, MiB, LIVE)
    if place == "block":
        held["frames"] = 7
    else:
        del held["frames"]
        held["history"] = [{"addr": 0, "real_size": MiB, "frames": 3.5}]
    return {"device_traces": [[]], "segments": [segment(0, 2 * MiB, [held])]}


@pytest.mark.parametrize("place", ["entry", "block", "block history"])
def test_frames_that_are_not_a_list_count_as_none(tmp_path, place):
    advice = gpupool.advise(write(tmp_path, frameless(place)))
    expected = (sites.UNKNOWN, 40 * MiB) if place == "entry" else (sites.BEFORE_RECORDING, MiB)
    assert expected in advice.top_sites


@pytest.mark.parametrize("requested_size", [None, 19 * MiB], ids=["2.0.0", "2.0.1"])
def test_a_pytorch_2_0_block_is_advised_by_its_newest_allocation(tmp_path, requested_size):
    # PyTorch 2.0 keeps a block's frames (and, in 2.0.0, its requested size) in its history,
    # newest first; an unsplit block also keeps allocations older than its own, past its end.
    def allocation(addr: int, real_size: int, name: str) -> dict:
        return {"addr": addr, "real_size": real_size, "frames": [{"filename": f"{name}.py", "line": 1, "name": name}]}

    at = 1 << 30
    held = {
        "size": 20 * MiB,
        "state": LIVE,
        "history": [allocation(at, 19 * MiB, "now"), allocation(at + 19 * MiB, 9, "old")],
    }
    if requested_size:
        held["requested_size"] = requested_size
    advice = gpupool.advise(write(tmp_path, {"device_traces": [[]], "segments": [segment(at, 20 * MiB, [held])]}))
    assert advice.peak_live_bytes == 19 * MiB
    assert advice.top_sites == [("now.py:1 (now)", 19 * MiB)]


def test_a_pytorch_1_13_snapshot_is_advised_on_its_live_blocks(tmp_path):
    # PyTorch 1.13's _snapshot() is the segments list alone; a block's history names what was
    # last allocated in it, not when, so it sizes and places the live block but is not replayed.
    def allocation(addr: int, real_size: int, name: str) -> dict:
        return {"addr": addr, "real_size": real_size, "frames": [{"filename": f"{name}.py", "line": 1, "name": name}]}

    at = 1 << 30
    live = {"size": 8 * MiB, "state": LIVE, "history": [allocation(at, 8 * MiB - 100, "now")]}
    freed = {"size": 12 * MiB, "state": "inactive", "history": [allocation(at + 8 * MiB, 12 * MiB, "old")]}
    segment_ = {
        "device": 0,
        "address": at,
        "total_size": 20 * MiB,
        "allocated_size": 8 * MiB,
        "active_size": 8 * MiB,
        "stream": 0,
        "segment_type": "large",
        "blocks": [live, freed],
    }
    advice = gpupool.advise(write(tmp_path, [segment_]))
    assert (advice.scope, advice.events, advice.peak_live_bytes) == ("segments", 1, 8 * MiB - 100)
    assert advice.top_sites == [("now.py:1 (now)", 8 * MiB - 100)]
    assert any(note.startswith("2 blocks carry a 'history'") and "not replayed" in note for note in advice.notes)


@pytest.mark.parametrize("state", ["active_pending_free", "active_awaiting_free"])
def test_a_block_waiting_on_another_stream_is_live(tmp_path, state):
    # PyTorch writes active_pending_free; its documented Snapshot type says active_awaiting_free.
    held = block(1 << 30, 2 * MiB, MiB, state)
    advice = gpupool.advise(write(tmp_path, {"device_traces": [[]], "segments": [segment(1 << 30, 2 * MiB, [held])]}))
    assert (advice.peak_live_bytes, advice.history_start) == (MiB, 1)


def test_the_progress_bar_shows_on_a_terminal_only(tmp_path):
    entries, segments = warmed_up()
    path = write(tmp_path, {"device_traces": [entries], "segments": segments})
    command = [sys.executable, "-m", "gpupool", "advise", str(path)]
    piped = subprocess.run(command, capture_output=True, text=True, check=True)
    assert piped.stderr == "" and "The answer" not in piped.stderr
    primary, secondary = pty.openpty()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=secondary) as process:
        os.close(secondary)
        out, _ = process.communicate(timeout=120)
        err = b""
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:
                break
            if not chunk:
                break
            err += chunk
    os.close(primary)
    assert b"job.pickle: loading" in err and b"] " in err and b"job.pickle: strategy:eager" in err
    assert b"Answer" in out


@pytest.mark.parametrize(
    ("recorded", "env", "inert"),
    [
        ({"max_split_size": -1, "garbage_collection_threshold": 0.0, "expandable_segments": False}, "", []),
        (
            {"max_split_size": 128 * MiB, "garbage_collection_threshold": 0.6},
            "max_split_size_mb:128,garbage_collection_threshold:0.6",
            [],
        ),
        (
            {
                "expandable_segments": True,
                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,pinned_use_background_threads:True",
            },
            "expandable_segments:True,pinned_use_background_threads:True",
            ["pinned_use_background_threads"],
        ),
        (
            {
                "PYTORCH_CUDA_ALLOC_CONF": "large_segment_size_mb:40, throw_on_cudamalloc_oom:True",
                "roundup_power2_divisions": {"1": 0, "2": 4},
            },
            "large_segment_size_mb:40,throw_on_cudamalloc_oom:True,roundup_power2_divisions:[1:0,2:4]",
            ["throw_on_cudamalloc_oom"],
        ),
    ],
)
def test_recorded_settings_become_the_line_the_user_set(recorded, env, inert):
    ran = settings.from_recorded(recorded)
    assert (ran.env, ran.inert) == (env, inert)
    config = settings.gpupool_config(env)
    assert config.startswith("strategy:expandable" if "expandable_segments:True" in env else "strategy:pytorch")
    gpupool.Pool("sim", capacity="1GiB", config=config)


def test_unknown_recorded_settings_are_named_not_fatal():
    ran = settings.from_recorded({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64,future_knob:3", "new_field": 1})
    assert ran.env == "max_split_size_mb:64"
    assert ran.unknown[0] == "new_field (recorded field)"
    assert ran.unknown[1].startswith("future_knob:3 (unknown config key 'future_knob'")


def test_the_recorded_switch_wins_over_the_string(tmp_path):
    # Where the platform lacks expandable segments PyTorch records the switch off and runs its
    # plain segments, whatever PYTORCH_CUDA_ALLOC_CONF asked: the run is replayed as it ran.
    entries, segments = warmed_up()
    recorded = {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:64",
        "expandable_segments": False,
    }
    ran = settings.from_recorded(recorded)
    assert (ran.env, ran.expandable) == ("max_split_size_mb:64", False)
    assert ran.unknown == ["expandable_segments:True (recorded as off: PyTorch ran its plain segments)"]
    advice = gpupool.advise(
        write(tmp_path, {"device_traces": [entries], "segments": segments, "allocator_settings": recorded})
    )
    assert advice.as_run.gpupool_config.startswith("strategy:pytorch")
    assert any("expandable_segments:True (recorded as off" in note for note in advice.notes)


UNREADABLE_SETTINGS = {
    "keys of mixed types": ({1: 2, "a": 3}, ["1 (recorded field)", "a (recorded field)"]),
    "divisions of None": ({"roundup_power2_divisions": {"1": None}}, ["roundup_power2_divisions (recorded field: "]),
    "divisions of inf": ({"roundup_power2_divisions": {"1": float("inf")}}, ["roundup_power2_divisions (recorded"]),
    "divisions of nan": ({"roundup_power2_divisions": {"1": float("nan")}}, ["roundup_power2_divisions (recorded"]),
    "divisions of text": ({"roundup_power2_divisions": {"1": "x"}}, ["roundup_power2_divisions (recorded field: "]),
    "a superscript start": ({"roundup_power2_divisions": {"²": 2}}, ["roundup_power2_divisions (recorded field: "]),
    "a contradiction": (
        {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "expandable_segments": True},
        ["expandable_segments:True ("],
    ),
}


@pytest.mark.parametrize("case", list(UNREADABLE_SETTINGS))
def test_unreadable_recorded_settings_are_named_and_left_out(case):
    recorded, unknown = UNREADABLE_SETTINGS[case]
    ran = settings.from_recorded(recorded)
    assert len(ran.unknown) == len(unknown)
    assert all(named.startswith(start) for named, start in zip(ran.unknown, unknown, strict=True)), ran.unknown
    gpupool.Pool("sim", capacity="1GiB", config=settings.gpupool_config(ran.env))


FIELDS = st.sampled_from(
    ["max_split_size", "garbage_collection_threshold", "expandable_segments", "roundup_power2_divisions"]
    + ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "backend"]
)
VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8))
CONF = st.lists(st.sampled_from(["backend:cudaMallocAsync", "expandable_segments:True", "max_split_size_mb:64"]))


@given(
    recorded=st.dictionaries(
        FIELDS | VALUES,
        VALUES | CONF.map(",".join) | st.dictionaries(st.text(max_size=3) | st.integers(), VALUES, max_size=3),
        max_size=5,
    )
)
def test_any_recorded_settings_give_a_configuration_gpupool_takes(recorded):
    ran = settings.from_recorded(recorded)
    gpupool.Pool("sim", capacity="1GiB", config=settings.gpupool_config(ran.env))


@pytest.mark.parametrize(
    ("capacity", "error", "message"),
    [
        (-5, ValueError, "capacity must be non-negative, got -5"),
        (0, ValueError, "capacity must be positive"),
        ("0.0001KiB", ValueError, "capacity must be positive"),
        ("0.1", ValueError, "capacity: '0.1' is not a whole number of bytes"),
        (2**70, ValueError, f"capacity {2**70} is absurdly large"),
        (1.5, TypeError, "capacity must be an int, not float"),
    ],
)
def test_a_bad_capacity_is_refused_as_replay_refuses_it(tmp_path, capacity, error, message):
    path = write(tmp_path, {"device_traces": [[entry("alloc", MiB, 8)]], "segments": []})
    for call in (gpupool.advise, gpupool.advise_each, gpupool.replay):
        with pytest.raises(error, match=message):
            call(path, capacity=capacity)
    if isinstance(capacity, str):
        with pytest.raises(SystemExit, match=f"gpupool advise: {message}"):
            cli.main(["advise", str(path), "--capacity", capacity])


def test_the_answer_says_how_much_a_device_is_short_or_spare(tmp_path, capsys):
    entries, segments = warmed_up()
    path = write(tmp_path, {"device_traces": [entries], "segments": segments})
    needs = gpupool.advise(path).recommended["gpupool"].min_capacity_bytes
    for capacity, said in (
        (needs - 3 * MiB, "does not fit on {} (3.00 MiB short)"),
        (needs + 5 * MiB, "fits on {} (5.00 MiB headroom)"),
    ):
        assert cli.main(["advise", str(path), "--capacity", str(capacity)]) == 0
        answer = capsys.readouterr().out.split("Answer")[1].split("gpupool:")[1]
        assert said.format(f"{capacity / MiB:.2f} MiB") in answer, answer


def test_a_small_shortfall_on_a_job_of_gibibytes_is_said_in_mebibytes(tmp_path, capsys):
    # The report's unit is GiB here; 3 MiB in it would print as "0.00 GiB short".
    entries = [entry("alloc", BASE, 1536 * MiB, 1), entry("free_requested", BASE, 1536 * MiB, 2)]
    path = write(tmp_path, {"device_traces": [entries], "segments": []})
    needs = gpupool.advise(path).recommended["gpupool"].min_capacity_bytes
    for capacity, said in (
        (needs - 3 * MiB, "does not fit on {} (3.00 MiB short)"),
        (needs + 5 * MiB, "fits on {} (5.00 MiB headroom)"),
        (needs + 2048 * MiB, "fits on {} (2.00 GiB headroom)"),
    ):
        assert cli.main(["advise", str(path), "--capacity", str(capacity)]) == 0
        answer = capsys.readouterr().out.split("Answer")[1].split("gpupool:")[1]
        assert said.format(f"{capacity / (1 << 30):.2f} GiB") in answer, answer


def test_no_difference_that_is_not_zero_is_said_as_zero():
    gib = _Units(1 << 30)
    # 0.005 GiB is 5,368,709.12 bytes: 5,368,709 prints as 0.00 GiB, 5,368,710 as 0.01 GiB.
    assert gib.difference(5_368_709) == "5.12 MiB"
    assert gib.difference(5_368_710) == "0.01 GiB"
    assert gib.difference(0) == "0.00 GiB"
    # Down to bytes, in a report of either unit.
    mib = _Units(1 << 20)
    assert (mib.difference(5_243), mib.difference(5_242), mib.difference(5), mib.difference(0)) == (
        "0.01 MiB",
        "5.12 KiB",
        "5 B",
        "0.00 MiB",
    )
    assert gib.difference(3_000) == "2.93 KiB"


@pytest.mark.parametrize("case", sorted(test_trace.MALFORMED_PICKLES | test_trace.OUT_OF_RANGE))
def test_a_snapshot_that_trace_load_refuses_advise_refuses_too(tmp_path, case):
    # The two readers check entries on paths of their own (advise's skips free requests).
    snapshot, _ = (test_trace.MALFORMED_PICKLES | test_trace.OUT_OF_RANGE)[case]
    with pytest.raises(ValueError, match=r"snap\.pickle"):
        gpupool.advise(write(tmp_path, snapshot, "snap.pickle"))
