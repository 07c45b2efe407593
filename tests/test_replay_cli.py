"""``gpupool replay``: tables, JSON and plots of traces replayed under configurations."""

from __future__ import annotations

import json
import pathlib
import pickle
import sys
import types
from unittest import mock

import numpy as np
import pytest

import gpupool
from gpupool import cli

SHARED_TRACES = pathlib.Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
TRACE = f"""Thread,Time,Action,Pointer,Size,Stream
0,0.0,allocate,0x10000,{8 << 20},0x0
0,0.1,allocate,0x20000,{8 << 20},0x0
0,0.2,free,0x10000,{8 << 20},0x0
0,0.3,allocate,0x30000,{12 << 20},0x0
0,0.4,free,0x20000,{8 << 20},0x0
0,0.5,free,0x30000,{12 << 20},0x0
"""


@pytest.fixture
def trace_file(tmp_path) -> pathlib.Path:
    path = tmp_path / "small.csv"
    path.write_text(TRACE)
    return path


def test_prints_a_row_per_trace_and_config(capsys, trace_file):
    argv = [
        "replay",
        str(trace_file),
        "--config",
        "strategy:pytorch,max_split_size_mb:20",
        "--config",
        "strategy:pytorch",
    ]
    assert cli.main([*argv, "--min-capacity"]) == 0
    out, err = capsys.readouterr()
    assert err == ""  # no progress bar when stderr is not a terminal
    lines = out.splitlines()
    assert lines[0].startswith("| trace | config | events | peak live | peak reserved |")
    assert "min capacity" in lines[0]
    assert lines[2].startswith("| small.csv | strategy:pytorch,max_split_size_mb:20 | 6 | 20.0 MiB | ")
    # Two segment allocations for three allocations: 666.7 device calls per 1000.
    assert lines[3].startswith("| small.csv | strategy:pytorch | 6 | 20.0 MiB | 32.0 MiB | 62.5% | 666.7 | 0 | ")
    assert len(lines) == 4


def test_a_search_that_finds_no_capacity_says_so(capsys, trace_file):
    # A millionth of the device: the pool would need a million times the trace's peak, beyond
    # where the search gives up, which used to read as 17,592,186,044,416.0 MiB (2**64 bytes).
    config = "strategy:pytorch,per_process_memory_fraction:0.000001"
    result = gpupool.replay(str(trace_file), config, min_capacity=True)
    assert result.min_capacity_bytes is None and result.min_capacity_utilization is None
    assert cli.main(["replay", str(trace_file), "--min-capacity", "--config", config]) == 0
    row = capsys.readouterr().out.splitlines()[2].split(" | ")
    assert row[-3:-1] == ["none found", ""], row
    assert cli.main(["replay", str(trace_file), "--min-capacity", "--json", "--config", config]) == 0
    assert json.loads(capsys.readouterr().out)[0]["min_capacity_bytes"] is None


def test_a_trace_no_device_can_serve_fits_no_capacity(capsys, tmp_path):
    # Each request is beyond what any device holds (4 EiB): every replay fails them all, and the
    # search, which lets such failures be, reported a min capacity of 0 MiB beside them.
    path = tmp_path / "impossible.csv"
    sizes = [(1 << 62) + 1, 1 << 63]
    rows = [f"0,{i}.0,allocate,0x{i + 1}0000,{size},0x0" for i, size in enumerate(sizes)]
    path.write_text("\n".join(["Thread,Time,Action,Pointer,Size,Stream", *rows, ""]))
    for config in ("strategy:pytorch", "strategy:default"):
        result = gpupool.replay(str(path), config, min_capacity=True)
        assert result.ooms == 2 and result.min_capacity_bytes is None, config
        assert result.min_capacity_utilization is None, config
    assert cli.main(["replay", str(path), "--min-capacity", "--config", "strategy:default"]) == 0
    row = capsys.readouterr().out.splitlines()[2].split(" | ")
    assert row[-4:-1] == ["2", "none found", ""], row


def test_json_has_the_figures_in_bytes(capsys, trace_file):
    argv = [
        "replay",
        str(trace_file),
        "--json",
        "--capacity",
        "24MiB",
        "--config",
        "strategy:pytorch",
    ]
    assert cli.main(argv) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["trace"] == "small.csv" and row["config"] == "strategy:pytorch"
    assert row["capacity_bytes"] == 24 << 20
    assert (row["peak_reserved_bytes"], row["ooms"]) == (20 << 20, 1)
    assert row["min_capacity_bytes"] is None
    # A rate, not a division by a zero duration (the JSON would say Infinity).
    assert 0 < row["events_per_second"] < float("inf")


def test_plot_draws_a_png(tmp_path, trace_file):
    pytest.importorskip("matplotlib")
    out = tmp_path / "memory.png"
    configs = ["--config", "", "--config", "max_split_size_mb:20"]
    assert cli.main(["replay", str(trace_file), *configs, "--plot", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG")


def test_a_plot_that_cannot_be_written_exits_with_a_message(tmp_path, trace_file, monkeypatch, capsys):
    # A stand-in for matplotlib whose figure writes where it is told, as savefig does.
    pyplot = types.ModuleType("matplotlib.pyplot")
    figure = types.SimpleNamespace(tight_layout=lambda: None, savefig=lambda path: open(path, "wb").close())
    axes = np.empty((1, 1), dtype=object)
    axes[0, 0] = mock.MagicMock()
    pyplot.subplots = lambda *_, **__: (figure, axes)
    pyplot.close = lambda _: None
    matplotlib = types.ModuleType("matplotlib")
    matplotlib.use, matplotlib.pyplot = (lambda _: None), pyplot
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    assert cli.main(["replay", str(trace_file), "--plot", str(tmp_path / "drawn.png")]) == 0
    assert (tmp_path / "drawn.png").exists()
    with pytest.raises(SystemExit, match=r"gpupool replay: cannot write .*memory\.png: .*No such file"):
        cli.main(["replay", str(trace_file), "--plot", str(tmp_path / "missing" / "memory.png")])
    assert "small.csv" in capsys.readouterr().out, "the table printed before the plot was drawn"


def test_reads_the_shared_traces(capsys):
    traces = sorted(SHARED_TRACES.glob("*.csv.gz"))
    if not traces:
        pytest.skip(f"no traces in {SHARED_TRACES}")
    assert cli.main(["replay", *map(str, traces)]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == [t.name for t in traces]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["replay", "missing.csv"], "No such file"),
        (["replay", "{trace}", "--config", "bogus:1"], "unknown config key 'bogus'"),
        (["replay", "{trace}", "--capacity", "lots"], "capacity"),
    ],
)
def test_errors_exit_with_a_message(trace_file, argv, message):
    with pytest.raises(SystemExit, match=message):
        cli.main([arg.format(trace=trace_file) for arg in argv])


def test_a_snapshot_value_beyond_64_bits_exits_with_a_message(tmp_path):
    path = tmp_path / "huge.pickle"
    entry = {"action": "alloc", "addr": 2**64, "size": 1, "stream": 0}
    path.write_bytes(pickle.dumps({"device_traces": [[entry]], "segments": []}))
    with pytest.raises(SystemExit, match=r"huge\.pickle, device_traces\[0\], entry 0: 'addr' must be .* below 2\*\*64"):
        cli.main(["replay", str(path)])


def two_device_snapshot(tmp_path) -> pathlib.Path:
    """Device 0 holds 8 MiB at its peak, device 1 holds 24 MiB; device 2 recorded nothing."""
    mib = 1 << 20
    zero = [
        {"action": "alloc", "addr": 0x1000, "size": 8 * mib},
        {"action": "free_completed", "addr": 0x1000, "size": 8 * mib},
    ]
    one = [{"action": "alloc", "addr": 0x2000 + i, "size": 12 * mib} for i in range(2)]
    path = tmp_path / "two.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [zero, one, []], "segments": []}))
    return path


def test_a_snapshot_of_several_devices_gives_a_row_per_device(capsys, tmp_path):
    path = two_device_snapshot(tmp_path)
    assert cli.main(["replay", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["trace"], r["peak_live_bytes"] >> 20) for r in rows] == [
        (f"{path.name}, device_traces[0]", 8),
        (f"{path.name}, device_traces[1]", 24),
    ]
    assert cli.main(["replay", str(path), "--device", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["trace"], r["peak_live_bytes"] >> 20) for r in rows] == [(f"{path.name}, device_traces[1]", 24)]
    # The Python API gives the same split.
    assert [len(t) for t in gpupool.trace.load_each(path)] == [2, 2]


@pytest.mark.parametrize(("device", "message"), [("3", r"no device 3 \(the snapshot has 3\)"), ("-1", "no device -1")])
def test_a_device_the_snapshot_lacks_exits_with_a_message(tmp_path, device, message):
    with pytest.raises(SystemExit, match=message):
        cli.main(["replay", str(two_device_snapshot(tmp_path)), "--device", device])


def test_a_csv_has_only_device_0(trace_file, capsys):
    assert cli.main(["replay", str(trace_file), "--device", "0"]) == 0
    assert capsys.readouterr().out.count("small.csv") == 1
    with pytest.raises(SystemExit, match="an RMM CSV holds one device's allocations; there is no device 1"):
        cli.main(["replay", str(trace_file), "--device", "1"])
