"""Traces: RMM CSV and PyTorch snapshot readers, history recording, snapshots PyTorch's viewer
reads, and replay on sim and host."""

from __future__ import annotations

import gzip
import itertools
import pathlib
import pickle
import pickletools
import random
import subprocess
import sys

import numpy as np
import pytest

import gpupool
from gpupool import _native
from gpupool import trace as gtrace
from gpupool._advice import snapshot as advise_snapshot
from pool_checks import BLOCK_KEYS, SEGMENT_KEYS, MiB

SHARED_TRACES = pathlib.Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
# From shared/traces/README.md: events and peak live MiB of each real trace.
KNOWN_TRACES = {
    "resnet50_train.csv.gz": (15_042, 1647.4),
    "llama_train.csv.gz": (12_148, 2285.5),
    "bert_serve_varbatch.csv.gz": (18_724, 665.2),
}

HEADER = "Thread,Time,Action,Pointer,Size,Stream"
SAMPLE = f"""{HEADER}
140573312345856,0.000000,allocate,0x7f8a40000000,1024,0x0
140573312345857,0.000250,allocate,0x7f8a40000400,2048,0x7f8a38001020
140573312345856,0.001000,free,0x7f8a40000000,1024,0x0
140573312345856,0.002000,allocate failure,(nil),1099511627776,0x0
140573312345857,0.003000,free,0x7f8a40000400,2048,0x7f8a38001020
"""


def shared_trace(name: str) -> pathlib.Path:
    path = SHARED_TRACES / name
    if not path.exists():
        pytest.skip(f"{path} is absent (the shared traces live beside the repository)")
    return path


def write(tmp_path: pathlib.Path, name: str, text: str) -> pathlib.Path:
    path = tmp_path / name
    path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    return path


@pytest.mark.parametrize("name", ["sample.csv", "sample.csv.gz"])
def test_reads_a_hand_made_rmm_csv(tmp_path, name):
    trace = gtrace.load(write(tmp_path, name, SAMPLE))
    assert len(trace) == 5
    assert trace.streams == [0, 0x7F8A38001020]
    assert trace.peak_live_bytes == 3072
    assert trace.allocations == 2
    events = list(trace)
    assert [e.action for e in events] == ["alloc", "alloc", "free", "oom", "free"]
    assert events[1] == gtrace.Event("alloc", 0x7F8A40000400, 2048, 0x7F8A38001020, 250.0)
    assert events[4].size == 2048
    assert "sample.csv" in repr(trace)


@pytest.mark.parametrize("name", sorted(KNOWN_TRACES))
def test_reads_the_shared_traces(name):
    trace = gtrace.load(shared_trace(name))
    events, peak_mib = KNOWN_TRACES[name]
    assert len(trace) == events
    assert trace.peak_live_bytes / MiB == pytest.approx(peak_mib, abs=0.05)
    actions = [e.action for e in trace]
    assert actions.count("alloc") == actions.count("free") == trace.allocations


MALFORMED_CSV = {
    "bad header": ("Thread,Time,Action,Pointer\n", r"bad\.csv, line 1: bad header"),
    "unknown action": (
        f"{HEADER}\n0,0.0,realloc,0x10,8,0x0\n",
        r"bad\.csv, line 2: unknown action 'realloc'",
    ),
    "unknown free": (f"{HEADER}\n0,0.0,free,0x10,8,0x0\n", r"bad\.csv, line 2: free of 0x10"),
    "double free": (
        f"{HEADER}\n0,0.0,allocate,0x10,8,0x0\n0,0.1,free,0x10,8,0x0\n0,0.2,free,0x10,8,0x0\n",
        r"bad\.csv, line 4: free of 0x10",
    ),
    "bad size": (f"{HEADER}\n0,0.0,allocate,0x10,-8,0x0\n", r"bad\.csv, line 2: bad size '-8'"),
    "short row": (f"{HEADER}\n0,0.0,allocate,0x10,8\n", r"bad\.csv, line 2: expected 6 fields"),
    # Past 2**64 ns or bytes, release builds would wrap around silently.
    "a clock time past 2**64 ns": (
        f"{HEADER}\n0,99999999999999999:0:0.5,allocate,0x10,8,0x0\n",
        r"bad\.csv, line 2: bad time '99999999999999999:0:0\.5'",
    ),
    "more bytes live than 2**64": (
        f"{HEADER}\n0,0.0,allocate,0x10,{2**63},0x0\n0,0.1,allocate,0x20,{2**63},0x0\n",
        rf"bad\.csv, line 3: an allocation of {2**63} bytes takes the bytes live at once past 2\*\*64",
    ),
    # Read whole, a gzip bomb of one line would take gigabytes before failing.
    "a line without end": (f"{HEADER}\n" + "0" * (1 << 20), r"bad\.csv, line 2: the line is longer than 65536 bytes"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_CSV))
def test_malformed_csv_names_the_file_and_line(tmp_path, case):
    text, message = MALFORMED_CSV[case]
    with pytest.raises(ValueError, match=message):
        gtrace.load(write(tmp_path, "bad.csv", text))


def test_truncated_gzip_is_a_value_error(tmp_path):
    lines = [HEADER] + [f"0,{i}.0,allocate,{0x1000 * (i + 1):#x},512,0x0" for i in range(5000)]
    data = gzip.compress("\n".join(lines).encode())
    path = tmp_path / "cut.csv.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.csv\.gz, line \d+: .*truncated"):
        gtrace.load(path)


def entry(action: str, **fields) -> dict:
    return {"action": action, "stream": 0, **fields}


# A PyTorch snapshot as torch.cuda.memory._dump_snapshot pickles it, cut down: two blocks
# allocated before recording began (one freed in the trace, one never touched).
def torch_like_snapshot() -> dict:
    frames = [{"filename": "train.py", "line": 10, "name": "step"}]
    block = {"address": 0x1000, "size": 1024, "requested_size": 1000, "state": "active_allocated"}
    return {
        "segments": [
            {
                "device": 0,
                "address": 0x1000,
                "total_size": 2 << 20,
                "stream": 0,
                "segment_type": "small",
                "segment_pool_id": (0, 0),
                "blocks": [
                    dict(block, frames=frames),
                    dict(block, address=0x1400, state="inactive"),
                ],
            }
        ],
        "device_traces": [
            [
                entry("segment_alloc", addr=0x900000, size=2 << 20, time_us=10),
                entry("free_requested", addr=0x5000, size=512, time_us=11),
                entry("free_completed", addr=0x5000, size=512, time_us=11),
                entry("alloc", addr=0x6000, size=2048, time_us=12, frames=frames),
                entry("oom", device_free=0, size=1 << 40, time_us=13),
                entry("free_completed", addr=0x6000, size=2048, time_us=14),
                {"action": "snapshot", "time_us": 15},
            ]
        ],
        "allocator_settings": {"expandable_segments": False},
    }


def dump(tmp_path: pathlib.Path, obj, name: str = "snap.pickle") -> pathlib.Path:
    path = tmp_path / name
    data = pickle.dumps(obj, protocol=4)
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    return path


@pytest.mark.parametrize("name", ["snap.pickle", "snap.pickle.gz"])
def test_reads_a_pytorch_snapshot_pickle(tmp_path, name):
    trace = gtrace.load(dump(tmp_path, torch_like_snapshot(), name))
    events = [(e.action, e.address, e.size) for e in trace]
    assert events == [
        ("alloc", 0x5000, 512),  # freed in the trace, allocated before it
        ("alloc", 0x1000, 1000),  # live in the snapshot, never touched by the trace
        ("free", 0x5000, 512),
        ("alloc", 0x6000, 2048),
        ("oom", 0, 1 << 40),
        ("free", 0x6000, 2048),
    ]
    assert trace.peak_live_bytes == 1000 + 2048


def test_an_old_snapshot_without_block_addresses_places_its_blocks_by_their_sizes(tmp_path):
    # Older PyTorch versions list a segment's blocks in address order without addresses.
    snapshot = torch_like_snapshot()
    blocks = [
        {"size": 1024, "requested_size": 1000, "state": "active_allocated"},
        {"size": 512, "state": "inactive"},
        {"size": 2048, "requested_size": 2000, "state": "active_allocated"},
        {"size": 4096, "state": "active_pending_free"},
    ]
    snapshot["segments"][0]["blocks"] = blocks
    snapshot["device_traces"] = [[]]
    trace = gtrace.load(dump(tmp_path, snapshot))
    events = [(e.action, e.address, e.size) for e in trace]
    assert events == [("alloc", 0x1000, 1000), ("alloc", 0x1600, 2000), ("alloc", 0x1E00, 4096)]
    assert trace.peak_live_bytes == 1000 + 2000 + 4096


def pytorch_2_0_segment() -> dict:
    """A segment as PyTorch 2.0 lists it: blocks without addresses, requested sizes or frames,
    each with the history of the allocations made in it, newest first."""

    def allocation(addr: int, real_size: int, line: int) -> dict:
        return {"addr": addr, "real_size": real_size, "frames": [{"filename": "train.py", "line": line, "name": "f"}]}

    return {
        "device": 0,
        "address": 0x100000,
        "total_size": 22 * MiB,
        "stream": 0,
        "segment_type": "large",
        "blocks": [
            # 2 MiB + 1000 bytes rounds to 2 MiB + 1024; its earlier allocation was trimmed.
            {"size": 2 * MiB + 1024, "state": "active_allocated", "history": [allocation(0x100000, 2 * MiB + 1000, 1)]},
            # Not split (under 1 MiB would remain): the older allocation lies past the new one.
            {
                "size": 19 * MiB,
                "state": "active_pending_free",
                "history": [allocation(0x300400, 18 * MiB + 100, 2), allocation(0x1580000, 4096, 3)],
            },
            # Allocated while recording was off: its history is an older allocation's, elsewhere.
            {"size": 1 * MiB - 1024, "state": "active_allocated", "history": [allocation(0x1600000, 512, 4)]},
        ],
    }


def test_a_pytorch_2_0_snapshot_gives_what_its_blocks_requested(tmp_path):
    # 2.0 keeps one trace entry by default: here the snapshot's own, so no allocation is recorded.
    snapshot = {"segments": [pytorch_2_0_segment()], "device_traces": [[{"action": "snapshot", "addr": 0, "size": 0}]]}
    with pytest.warns(UserWarning, match="records no allocations, .* 'history' in 3 of its blocks"):
        trace = gtrace.load(dump(tmp_path, snapshot))
    events = [(e.action, e.address, e.size) for e in trace]
    assert events == [
        ("alloc", 0x100000, 2 * MiB + 1000),
        ("alloc", 0x300400, 18 * MiB + 100),
        ("alloc", 0x1600400, 1 * MiB - 1024),  # no request recorded for it: the rounded size
    ]


def pytorch_1_13_snapshot(state: str | None = None) -> list:
    """``torch.cuda.memory._snapshot()`` as PyTorch 1.13 returns it, for users to pickle: the list
    of segments alone, with no trace entries; its blocks are shaped as 2.0's. ``state`` sets
    every block's."""
    segment = dict(pytorch_2_0_segment(), allocated_size=3 * MiB, active_size=22 * MiB)
    for block in segment["blocks"]:
        block["state"] = state or block["state"]
    return [segment]


def test_a_pytorch_1_13_snapshot_gives_its_live_blocks_and_says_their_history_is_not_replayed(tmp_path):
    # A 1.13 block's history names what was last allocated in it, not when: no replay in it.
    path = dump(tmp_path, pytorch_1_13_snapshot())
    said = r"device 0 records no allocations, only the 3 blocks live before recording or at the snapshot; the"
    with pytest.warns(UserWarning, match=said):
        trace = gtrace.load(path)
    assert [(e.action, e.address, e.size) for e in trace] == [
        ("alloc", 0x100000, 2 * MiB + 1000),
        ("alloc", 0x300400, 18 * MiB + 100),
        ("alloc", 0x1600400, 1 * MiB - 1024),
    ]
    # Nothing live: an empty trace, and the warning says why.
    with pytest.warns(UserWarning, match=r"only the 0 blocks live .* the 'history' in 3 of its blocks"):
        assert len(gtrace.load(dump(tmp_path, pytorch_1_13_snapshot("inactive")))) == 0


@pytest.mark.parametrize("state", ["active_allocated", "active_pending_free", "active_awaiting_free"])
def test_a_block_in_any_live_state_was_allocated_before_recording(tmp_path, state):
    # PyTorch writes active_pending_free; its documented Snapshot type says active_awaiting_free.
    trace = gtrace.load(dump(tmp_path, live_block(block={"state": state})))
    assert [(e.action, e.address, e.size) for e in trace] == [("alloc", 0x1000, 512)]


class Sneaky:
    """Unpickling this would create a file: the loader must refuse to."""

    def __init__(self, target: pathlib.Path) -> None:
        self.target = target

    def __reduce__(self):
        return (pathlib.Path.touch, (self.target,))


def snapshot_with(entry) -> dict:
    return {"segments": [], "device_traces": [[{"action": "alloc", "addr": 16, "size": 8}, entry]]}


MALFORMED_PICKLES = {
    "double free": (
        {
            "device_traces": [
                [
                    {"action": "alloc", "addr": 16, "size": 8},
                    {"action": "free_completed", "addr": 16, "size": 8},
                    {"action": "free_completed", "addr": 16, "size": 8},
                ]
            ]
        },
        r"snap\.pickle, device_traces\[0\], entry 2: free of 0x10",
    ),
    "entry not a dict": (snapshot_with([1, 2]), r"entry 1: expected a dict"),
    # Unhashable: looked up in a set of actions, it would raise a TypeError.
    "action a list": (snapshot_with({"action": ["alloc"], "addr": 32, "size": 1}), r"entry 1: expected a dict with an"),
    "missing size": (snapshot_with({"action": "alloc", "addr": 32}), r"entry 1: 'size' must be"),
    "not a snapshot": ({"blocks": []}, r"snap\.pickle: not a memory snapshot"),
    "traces not lists": ({"segments": [], "device_traces": [None]}, r"snap\.pickle: not a memory snapshot"),
    "a list, not of segments": ([{"address": 1}, 2], r"snap\.pickle: not a memory snapshot"),
}


ABOVE_U64 = r"must be a non-negative int below 2\*\*64, got"


def live_block(**fields) -> dict:
    """A snapshot whose one segment holds a block allocated before recording began."""
    block = {"address": 0x1000, "size": 512, "state": "active_allocated", **fields.pop("block", {})}
    return {"device_traces": [[]], "segments": [{"address": 0x1000, "total_size": 512, "blocks": [block], **fields}]}


# Values the native trace holds in 64 bits: beyond them, OverflowError tracebacks came instead.
OUT_OF_RANGE = {
    "addr 2**64": (snapshot_with(entry("alloc", addr=2**64, size=1)), rf"entry 1: 'addr' {ABOVE_U64} {2**64}"),
    "size 2**64": (snapshot_with(entry("alloc", addr=32, size=2**64)), rf"entry 1: 'size' {ABOVE_U64}"),
    "stream 2**64": (snapshot_with(dict(entry("alloc", addr=32, size=1), stream=2**64)), rf"'stream' {ABOVE_U64}"),
    "device_free 2**64": (snapshot_with(entry("oom", device_free=2**64, size=1)), rf"'device_free' {ABOVE_U64}"),
    "time_us 10**400": (snapshot_with(entry("alloc", addr=32, size=1, time_us=10**400)), r"'time_us' must be a finite"),
    "time_us inf": (snapshot_with(entry("alloc", addr=32, size=1, time_us=float("inf"))), r"'time_us' must be"),
    "time_us nan": (snapshot_with(entry("alloc", addr=32, size=1, time_us=float("nan"))), r"'time_us' must be"),
    "live block address -5": (live_block(block={"address": -5}), rf"segment 0, block 0: 'address' {ABOVE_U64} -5"),
    "live block size 2**64": (live_block(block={"requested_size": 2**64}), rf"block 0: 'requested_size' {ABOVE_U64}"),
    "segment stream -1": (live_block(stream=-1), rf"snap\.pickle, segment 0: 'stream' {ABOVE_U64} -1"),
    # Skipped, these live blocks would vanish from the replay without a word.
    "live block size '512'": (live_block(block={"size": "512"}), rf"segment 0, block 0: 'size' {ABOVE_U64} '512'"),
    "live block stream 'x'": (live_block(stream="x"), rf"snap\.pickle, segment 0: 'stream' {ABOVE_U64} 'x'"),
    "no address to follow": (
        dict(live_block(), segments=[{"total_size": 512, "blocks": [{"size": 512, "state": "active_allocated"}]}]),
        rf"segment 0, block 0: 'address' {ABOVE_U64} None",
    ),
}

MALFORMED_PICKLES |= {
    "block not a dict": (live_block(blocks=[512]), r"snap\.pickle, segment 0, block 0: expected a dict, got 512"),
    "blocks not a list": (live_block(blocks=512), r"snap\.pickle, segment 0: 'blocks' must be a list, got 512"),
}


@pytest.mark.parametrize("case", list(OUT_OF_RANGE))
def test_values_beyond_64_bits_are_value_errors_naming_the_field(tmp_path, case):
    snapshot, message = OUT_OF_RANGE[case]
    with pytest.raises(ValueError, match=message):
        gtrace.load(dump(tmp_path, snapshot))


@pytest.mark.parametrize("case", sorted(MALFORMED_PICKLES))
def test_malformed_snapshots_name_the_file_and_entry(tmp_path, case):
    snapshot, message = MALFORMED_PICKLES[case]
    with pytest.raises(ValueError, match=message):
        gtrace.load(dump(tmp_path, snapshot))


def test_entries_of_unknown_actions_are_skipped_with_a_warning(tmp_path):
    # A vendor's action (torch_npu's) and a newer PyTorch's, among known ones.
    known = [
        {"action": "alloc", "addr": 16, "size": 8, "time_us": 1},
        {"action": "alloc", "addr": 64, "size": 32, "time_us": 3},
        {"action": "free_completed", "addr": 16, "size": 8, "time_us": 5},
    ]
    unknown = [{"action": "workspace_snapshot", "addr": 0, "size": 4096}, {"action": "realloc", "time_us": 9}]
    entries = [known[0], unknown[0], known[1], unknown[0], known[2], unknown[1]]
    with pytest.warns(UserWarning) as caught:
        mixed = gtrace.load(dump(tmp_path, {"segments": [], "device_traces": [entries]}))
    assert sorted(str(w.message).split("/")[-1] for w in caught) == [
        "snap.pickle, device_traces[0]: skipped 1 'realloc' entries this version does not know",
        "snap.pickle, device_traces[0]: skipped 2 'workspace_snapshot' entries this version does not know",
    ]
    assert all(w.filename == __file__ for w in caught), "the warning points at the caller of load"
    plain = gtrace.load(dump(tmp_path, {"segments": [], "device_traces": [known]}))
    assert list(mixed) == list(plain) and len(plain) == 3
    # Errors after a skipped entry still name the entry by its own index.
    broken = [*entries[:5], {"action": "free_completed", "addr": 16, "size": 8}]
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"device_traces\[0\], entry 5: free of 0x10"):
        gtrace.load(dump(tmp_path, {"segments": [], "device_traces": [broken]}))


@pytest.mark.parametrize("made", ["unknown action", "1.13 history"])
def test_the_readers_warnings_point_at_the_line_that_read_the_snapshot(tmp_path, made):
    unknown = snapshot_with({"action": "realloc", "time_us": 9})
    snapshot = unknown if made == "unknown action" else pytorch_1_13_snapshot()
    path = dump(tmp_path, snapshot)
    readers = {
        "from_snapshot": lambda: gtrace.from_snapshot(snapshot),
        "load": lambda: gtrace.load(path),
        "load_each": lambda: gtrace.load_each(path),
    }
    for reader, read in readers.items():
        with pytest.warns(UserWarning) as caught:
            read()
        assert [(w.filename, w.lineno) for w in caught] == [(__file__, read.__code__.co_firstlineno)], reader


def test_a_pickle_carrying_objects_is_refused_without_running_it(tmp_path):
    target = tmp_path / "pwned"
    path = dump(tmp_path, snapshot_with(Sneaky(target)))
    with pytest.raises(ValueError, match=r"snap\.pickle: .*pathlib\..*Path\.touch object"):
        gtrace.load(path)
    assert not target.exists()


def test_a_truncated_pickle_is_a_value_error(tmp_path):
    path = dump(tmp_path, torch_like_snapshot())
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ValueError, match=r"snap\.pickle: not a readable PyTorch memory snapshot"):
        gtrace.load(path)


def test_snapshots_of_several_devices_need_a_choice(tmp_path):
    entries = [{"action": "alloc", "addr": 16, "size": 8}]
    path = dump(tmp_path, {"segments": [], "device_traces": [entries, entries]})
    with pytest.raises(ValueError, match=r"devices \[0, 1\] have traces"):
        gtrace.load(path)
    assert len(gtrace.load(path, device=1)) == 1
    with pytest.raises(ValueError, match="no device 2"):
        gtrace.load(path, device=2)


@pytest.mark.parametrize("device", [True, "1", 1.0])
def test_a_device_that_is_not_an_int_is_a_type_error(tmp_path, device):
    entries = [{"action": "alloc", "addr": 16, "size": 8}]
    path = dump(tmp_path, {"segments": [], "device_traces": [entries, entries]})
    with pytest.raises(TypeError, match=f"device must be an int, got {device!r}"):
        gtrace.load(path, device=device)
    with pytest.raises(TypeError, match="device must be an int"):
        gtrace.from_snapshot({"segments": [], "device_traces": [entries, entries]}, device=device)
    assert len(gtrace.load(path, device=np.int64(1))) == 1


def test_a_snapshot_without_history_is_read_on_the_device_holding_its_segments(tmp_path):
    # Recording off on a two-GPU job that used cuda:1: no entries, one segment on device 1.
    held = live_block()
    held["segments"][0]["device"] = 1
    held["device_traces"] = [[], []]
    path = dump(tmp_path, held)
    assert [(e.action, e.address, e.size) for e in gtrace.load(path)] == [("alloc", 0x1000, 512)]
    assert [len(t) for t in gtrace.load_each(path)] == [1]
    held["segments"].append(dict(held["segments"][0], device=0))
    path = dump(tmp_path, held)
    with pytest.raises(ValueError, match=r"devices \[0, 1\] have segments; pick one"):
        gtrace.load(path)
    assert [len(t) for t in gtrace.load_each(path)] == [1, 1]


def test_a_device_with_only_live_blocks_beside_a_recorded_one_is_read_too(tmp_path):
    # A two-GPU job recorded after it had filled cuda:1, then used only cuda:0: cuda:1's tensors
    # are in its segments, not its (empty) trace. A third segment on cuda:2 holds no live block.
    snapshot = live_block()
    snapshot["segments"][0]["device"] = 1
    cached = {"address": 0x9000, "size": 512, "state": "inactive"}
    snapshot["segments"].append({"device": 2, "address": 0x9000, "total_size": 512, "blocks": [cached]})
    snapshot["device_traces"] = [[entry("alloc", addr=0x5000, size=64)], [], []]
    path = dump(tmp_path, snapshot)
    assert [[(e.action, e.address, e.size) for e in t] for t in gtrace.load_each(path)] == [
        [("alloc", 0x5000, 64)],
        [("alloc", 0x1000, 512)],
    ]
    with pytest.raises(ValueError, match=r"devices \[0, 1\] have traces or live blocks; pick one"):
        gtrace.load(path)
    assert len(gtrace.load(path, device=1)) == 1
    assert len(gtrace.load(path, device=2)) == 0
    # Segments of a device past the traces' list are read the same way.
    snapshot["device_traces"] = [[entry("alloc", addr=0x5000, size=64)]]
    path = dump(tmp_path, snapshot)
    assert [len(t) for t in gtrace.load_each(path)] == [1, 1]
    with pytest.raises(ValueError, match=r"no device 3 \(the snapshot has 1\)"):
        gtrace.load(path, device=3)


@pytest.mark.parametrize("form", ["torch.cuda.memory_snapshot()", "a dict of segments", "device_traces None"])
def test_segments_alone_are_read_as_the_blocks_live_in_them(tmp_path, form):
    # torch.cuda.memory_snapshot() is the segments list of _snapshot(), without device_traces.
    segments = live_block()["segments"]
    segments[0]["blocks"].append({"address": 0x1200, "size": 256, "state": "inactive"})
    shapes = {
        "torch.cuda.memory_snapshot()": segments,
        "a dict of segments": {"segments": segments},
        "device_traces None": {"segments": segments, "device_traces": None},
    }
    path = dump(tmp_path, shapes[form])
    assert [(e.action, e.address, e.size) for e in gtrace.load(path)] == [("alloc", 0x1000, 512)]
    assert [len(t) for t in gtrace.load_each(path)] == [1]
    (record,) = advise_snapshot.read(path).devices
    assert [(b.address, b.size, b.live) for b in record.segments[0].blocks] == [
        (0x1000, 512, True),
        (0x1200, 256, False),
    ]


def run_workload(pool: gpupool.Pool, steps: int = 400, seed: int = 7) -> None:
    """Allocations of mixed sizes with frees in between, leaving some live at the end."""
    rng = random.Random(seed)
    live = []
    for _ in range(steps):
        if live and rng.random() < 0.45:
            live.pop(rng.randrange(len(live))).free()
        else:
            live.append(pool.alloc(int(2 ** rng.uniform(8, 25))))
    for ptr in live[: len(live) // 2]:
        ptr.free()
    pool.empty_cache()
    live.clear()


@pytest.mark.parametrize("config", [None, "max_split_size_mb:40"])
def test_record_dump_load_replay_gives_the_same_peaks(tmp_path, config):
    pool = gpupool.Pool("sim", capacity="4GiB", config=config)
    pool.record_history(max_entries=100_000)
    run_workload(pool)
    path = tmp_path / "recorded.csv.gz"
    # The workload's empty_cache() has no word in RMM's log.
    with pytest.warns(UserWarning, match="1 release of cached memory left out"):
        pool.dump_trace(path)
    trace = gtrace.load(path)
    result = gpupool.replay(trace, config=config, capacity="4GiB")
    stats = pool.memory_stats()
    assert result.peak_reserved_bytes == pool.max_memory_reserved()
    assert result.peak_live_bytes == stats["requested_bytes.all.peak"]
    assert result.device_allocs == stats["num_device_alloc"]
    assert result.ooms == 0
    from_snapshot = gpupool.replay(gtrace.from_snapshot(pool.snapshot()), config=config)
    assert from_snapshot.peak_reserved_bytes == result.peak_reserved_bytes


def test_history_is_a_ring_and_can_be_switched_off(tmp_path):
    pool = gpupool.Pool("sim", capacity="1GiB")
    with pytest.raises(ValueError, match="record_history"):
        pool.dump_trace(tmp_path / "none.csv")
    assert pool.snapshot()["device_traces"] == [[]]
    pool.record_history(max_entries=4)
    for _ in range(3):
        pool.alloc(4096).free()
    entries = pool.snapshot()["device_traces"][0]
    actions = [e["action"] for e in entries]
    assert actions == ["free_completed", "alloc", "free_requested", "free_completed"]
    pool.record_history(enabled=False)
    assert pool.snapshot()["device_traces"] == [[]]
    with pytest.raises(ValueError, match="at least 1"):
        pool.record_history(max_entries=0)


# What PyTorch's memory_viz reads (REFERENCE §2, MemoryViz.js).
SNAPSHOT_KEYS = {"segments", "device_traces", "allocator_settings"}
ENTRY_KEYS = {"action", "addr", "size", "stream", "time_us", "frames"}
# The opcodes memory_viz's JavaScript unpickler understands (protocols 2 to 4).
VIEWER_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_LIST", "LIST", "APPEND", "APPENDS",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "BININT", "BININT1", "BININT2", "LONG1",
    "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE", "NEWTRUE", "NEWFALSE", "NONE",
}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "segment_actions"),
    [
        ("strategy:pytorch", {"segment_alloc", "segment_free"}),
        ("strategy:default", {"segment_map", "segment_unmap"}),
    ],
)
def test_a_pool_snapshot_has_every_key_the_viewer_reads(config, segment_actions):
    pool = gpupool.Pool("sim", capacity=64 * MiB, config=config)
    pool.record_history()
    kept = [pool.alloc(size) for size in (1000, 3 * MiB, 24 * MiB)]
    pool.alloc(5000).free()
    with pytest.raises(gpupool.OutOfMemoryError):
        pool.alloc(60 * MiB)
    kept.pop().free()
    pool.empty_cache()
    snapshot = pool.snapshot()
    assert SNAPSHOT_KEYS <= set(snapshot)
    assert snapshot["segments"]
    for segment in snapshot["segments"]:
        assert SEGMENT_KEYS <= set(segment)
        # The viewer places blocks by adding up sizes from the segment's address.
        address = segment["address"]
        for block in segment["blocks"]:
            assert BLOCK_KEYS <= set(block)
            assert block["address"] == address
            address += block["size"]
        assert address == segment["address"] + segment["total_size"]
    (entries,) = snapshot["device_traces"]
    actions = {e["action"] for e in entries}
    assert actions == {"alloc", "free_requested", "free_completed", "oom"} | segment_actions
    for entry in entries:
        keys = ENTRY_KEYS - {"addr"} | {"device_free"} if entry["action"] == "oom" else ENTRY_KEYS
        assert keys <= set(entry), entry
    assert all(a["time_us"] <= b["time_us"] for a, b in itertools.pairwise(entries))
    # pickle.dump's default protocol on Python 3.10 to 3.13 is 4, the newest the viewer reads.
    data = pickle.dumps(snapshot, protocol=4)
    assert {op.name for op, _, _ in pickletools.genops(data)} <= VIEWER_OPCODES


def test_replay_counts_ooms_and_keeps_going():
    trace = gtrace.load(shared_trace("llama_train.csv.gz"))
    unlimited = gpupool.replay(trace)
    tight = gpupool.replay(trace, capacity=unlimited.peak_reserved_bytes // 2)
    assert unlimited.ooms == 0 < tight.ooms
    assert tight.events == len(trace)
    assert tight.peak_reserved_bytes <= unlimited.peak_reserved_bytes // 2
    assert tight.min_capacity_bytes is None


@pytest.mark.parametrize("name", sorted(KNOWN_TRACES))
def test_min_capacity_fits_and_sim_agrees_with_host(name):
    trace = gtrace.load(shared_trace(name))
    result = gpupool.replay(trace, min_capacity=True)
    minimum = result.min_capacity_bytes
    assert trace.peak_live_bytes <= minimum <= result.peak_reserved_bytes
    assert result.min_capacity_utilization == pytest.approx(trace.peak_live_bytes / minimum)
    assert gpupool.replay(trace, capacity=minimum).ooms == 0
    for capacity in (minimum, int(minimum * 0.9)):
        on_sim = gpupool.replay(trace, capacity=capacity)
        on_host = gpupool.replay(trace, capacity=capacity, device="host")
        figures = ("peak_live_bytes", "peak_reserved_bytes", "device_allocs", "ooms")
        assert [getattr(on_host, f) for f in figures] == [getattr(on_sim, f) for f in figures]
        assert on_host.timeline == on_sim.timeline


def test_min_capacity_is_bisected_to_a_fiftieth_of_a_percent():
    # Both searches halve the same interval; the finer one goes on from where the 0.5% one
    # stops, to a capacity that fits and lies above one that failed, within 0.5% of it. Each
    # then answers the peak its replay there reserved, which fits too (whole pages), and checks
    # it: the coarse answer fails 0.5% below itself, so it is at most 0.5% above the fine one.
    trace = gtrace.load(shared_trace("resnet50_train.csv.gz"))
    fine = gpupool.replay(trace, "strategy:default", min_capacity=True).min_capacity_bytes
    coarse = _native.replay(trace._native, "strategy:default", None, True, "sim", 0.005).min_capacity_bytes
    assert coarse * (1 - 0.005) <= fine <= coarse
    assert gpupool.replay(trace, "strategy:default", capacity=fine).ooms == 0
    for bad in (0.0, 1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="tolerance"):
            _native.replay(trace._native, None, None, True, "sim", bad)


def test_timeline_covers_the_trace_and_keeps_the_peaks():
    trace = gtrace.load(shared_trace("resnet50_train.csv.gz"))
    result = gpupool.replay(trace, config="max_split_size_mb:64")
    events, reserved, live = result.timeline
    assert events[0] == 0 and events[-1] < len(trace) and len(events) <= 2000
    assert max(reserved) == result.peak_reserved_bytes
    assert max(live) == result.peak_live_bytes
    assert result.config == "max_split_size_mb:64"
    assert result.events_per_second > 0


def test_replay_takes_a_path_and_rejects_bad_arguments(tmp_path):
    path = write(tmp_path, "sample.csv", SAMPLE)
    assert gpupool.replay(path).peak_live_bytes == 3072
    with pytest.raises(ValueError, match="unknown config key 'bogus'"):
        gpupool.replay(path, config="bogus:1")
    with pytest.raises(ValueError, match="unknown device"):
        gpupool.replay(path, device="tpu")


def step_back_through(snapshot: dict) -> None:
    """What memory_viz's "Allocator State History" does to show any past moment: start from the
    snapshot's segments and blocks, undo the trace entries from the newest. Each undo needs the
    block or segment it touches to exist at that point."""
    segments = {s["address"] for s in snapshot["segments"]}
    blocks = {
        b["address"]: b["state"] == "active_pending_free"
        for s in snapshot["segments"]
        for b in s["blocks"]
        if b["state"] in ("active_allocated", "active_pending_free")
    }
    for e in reversed(snapshot["device_traces"][0]):
        action = e["action"]
        if action == "alloc":
            assert blocks.pop(e["addr"]) is False, e
        elif action == "free_requested":
            assert blocks[e["addr"]] is True, e
            blocks[e["addr"]] = False
        elif action == "free_completed":
            assert e["addr"] not in blocks, e
            blocks[e["addr"]] = True
        elif action == "segment_alloc":
            segments.remove(e["addr"])
        elif action == "segment_free":
            assert e["addr"] not in segments, e
            segments.add(e["addr"])


def test_the_viewer_can_step_back_through_a_recorded_history():
    pool = gpupool.Pool("sim", capacity="1GiB")
    pool.record_history(max_entries=10_000)
    side = pool.stream()
    run_workload(pool, steps=200)
    held = pool.alloc(3 * MiB)
    side.hold()
    held.record_stream(side)
    held.free()  # pending until the side stream is synchronized
    step_back_through(pool.snapshot())
    side.synchronize()
    again = pool.alloc(3 * MiB)
    snapshot = pool.snapshot()
    assert [e["action"] for e in snapshot["device_traces"][0][-2:]] == ["free_completed", "alloc"]
    step_back_through(snapshot)
    gpupool.replay(gtrace.from_snapshot(snapshot))
    again.free()


def test_a_gzip_bomb_is_refused_before_it_exhausts_memory(tmp_path, monkeypatch):
    # 64 MiB of zeros compress to about 64 KiB: a small file that would expand past the limit.
    path = tmp_path / "bomb.pickle.gz"
    with gzip.open(path, "wb") as out:
        out.write(pickle.dumps({"segments": []}, protocol=4))
        out.write(bytes(64 << 20))
    monkeypatch.setattr(gtrace, "_decompressed_limit", lambda: 16 << 20)
    with pytest.raises(ValueError, match="bomb.pickle.gz.*decompresses to more than 16 MiB"):
        gtrace.load(path)


def test_a_damaged_gzip_stream_is_a_value_error_naming_the_file(tmp_path):
    data = bytearray(gzip.compress(pickle.dumps({"segments": []}, protocol=4) * 1000))
    data[len(data) // 2] ^= 0xFF  # corrupt the deflate stream past its header
    path = tmp_path / "damaged.pickle.gz"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="damaged.pickle.gz"):
        gtrace.load(path)


# In a child: an int passed for a path used to be opened as a file descriptor and closed.
DESCRIPTOR_CHILD = """
import os, sys, gpupool
call = {"load": gpupool.trace.load, "replay": gpupool.replay, "advise": gpupool.advise}[sys.argv[1]]
try:
    call(0)
except TypeError as error:
    print("TypeError:", error)
os.fstat(0)
print("stdin is open")
"""


@pytest.mark.parametrize("call", ["load", "replay", "advise"])
def test_an_int_is_no_path_and_its_descriptor_stays_open(call):
    command = [sys.executable, "-c", DESCRIPTOR_CHILD, call]
    child = subprocess.run(command, input=SAMPLE.encode(), capture_output=True, timeout=60, check=False)
    assert child.stdout.decode().splitlines() == [
        "TypeError: expected str, bytes or os.PathLike object, not int",
        "stdin is open",
    ], child.stderr.decode()[-2000:]


@pytest.mark.parametrize(
    "snapshot, error",
    [
        # A segment's device as gpupool advise reads it: a bool, float or negative one is an error
        # naming the segment, not a device whose live blocks vanish.
        ({"segments": [{"device": True}]}, r"segment 0: 'device' must be a non-negative int"),
        ({"segments": [{"device": 1.0}]}, r"segment 0: 'device' must be a non-negative int"),
        ({"segments": [{"device": -1}], "device_traces": [[]]}, r"segment 0: 'device' must be"),
        ({"segments": [{"device": 1 << 70}], "device_traces": []}, r"segment 0: 'device' must be"),
        ({"segments": [live_block()["segments"][0], 3]}, r"segment 1: expected a dict, got 3"),
        # device_traces[0] pickled alone is a list of dicts, but no segments.
        ([{"action": "alloc", "addr": 16, "size": 8}], r"not a memory snapshot"),
    ],
)
def test_segments_are_read_as_advise_reads_them(tmp_path, snapshot, error):
    for segment in snapshot["segments"] if isinstance(snapshot, dict) else []:
        if isinstance(segment, dict):
            segment.setdefault("address", 0x1000)
            segment.setdefault("total_size", 512)
            segment.setdefault("blocks", [{"address": 0x1000, "size": 512, "state": "active_allocated"}])
    path = dump(tmp_path, snapshot)
    with pytest.raises(ValueError, match=error):
        gtrace.load(path)
    with pytest.raises(ValueError, match=error):
        gtrace.load_each(path)
    with pytest.raises(ValueError):
        gpupool.advise(path)


def test_advise_reads_the_segments_list_as_trace_does():
    segments = live_block()["segments"]
    assert len(gtrace.from_snapshot(segments)) == 1
    assert gpupool.advise(segments).device == 0
