"""The CPU-side parts of the GPU check: benches/gpu_bench.py's workloads, table and arguments
(run on host), and benches/gpu_check.sh's refusal without a wheel. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import bench_scripts
import pytest

BENCHES = Path(__file__).parent.parent / "benches"
gpu_bench = bench_scripts.load("gpu_bench")


def test_the_article_workloads():
    hold, pairs, mixed = gpu_bench.workloads()
    assert (len(hold.sizes), len(pairs.sizes), len(mixed.sizes)) == (1000, 1000, 500)
    assert set(hold.sizes) == {gpu_bench.MiB} and hold.hold_all and not pairs.hold_all
    assert 1024 <= min(mixed.sizes) and max(mixed.sizes) <= 16 * gpu_bench.MiB
    assert mixed.sizes == gpu_bench.workloads()[2].sizes, "seeded"
    small = gpu_bench.workloads(0.01)
    assert [len(w.sizes) for w in small] == [10, 10, 5]


def test_table_and_verdicts():
    R = gpu_bench.Result
    results = [
        R("w", "gpupool.Pool", 10, [0.001, 0.001]),
        R("w", "cudaMalloc", 10, [0.1, 0.1]),
        R("w", "PyTorch caching allocator", 10, [0.0005]),
        R("w", "CuPy MemoryPool", 10, [0.002]),
    ]
    table = gpu_bench.format_table(results).splitlines()
    assert table[0].startswith("| workload |") and len(table) == 2 + len(results)
    assert "| w | gpupool.Pool | 1.000 | 100.000 | 100.0x | - |" in table
    assert "| w | cudaMalloc | 100.000 | 10000.000 | 1.0x | 100.0x |" in table
    assert "| w | PyTorch caching allocator | 0.500 | 50.000 | 200.0x | 0.5x |" in table
    verdicts = gpu_bench.verdicts(results)
    assert "PASS w: 100.0x faster than cudaMalloc (target 50x)" in verdicts
    assert any(v.startswith("MISS") and "PyTorch" in v for v in verdicts)
    assert any(v.startswith("PASS") and "CuPy" in v for v in verdicts)


def test_arguments():
    args = gpu_bench.parse_args(["--device", "host", "--runs", "2", "--scale", "0.5"])
    assert (args.device, args.runs, args.scale) == ("host", 2, 0.5)
    assert gpu_bench.parse_args([]).device in ("host", "cuda:0")
    for bad in (["--runs", "0"], ["--scale", "2"], ["--scale", "0"]):
        with pytest.raises(SystemExit):
            gpu_bench.parse_args(bad)


def test_a_whole_run_on_host(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert gpu_bench.main(["--device", "host", "--runs", "1", "--scale", "0.01", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| gpupool.Pool |" in printed and "host malloc" in printed
    timings = json.loads(out.read_text())
    assert len(timings) == 6 and all(len(t["seconds"]) == 1 for t in timings)


def test_a_failing_contender_is_noted_and_dropped():
    def refuse(size):
        raise MemoryError("no room")

    contenders = [
        gpu_bench.Contender("fine", lambda size: size, lambda handle: None),
        gpu_bench.Contender("broken", refuse, lambda handle: None),
    ]
    notes = []
    results = gpu_bench.measure(gpu_bench.workloads(0.01), contenders, 2, notes)
    assert {r.contender for r in results} == {"fine"} and all(len(r.seconds) == 2 for r in results)
    assert len(notes) == 3 and all("broken failed" in n and "no room" in n for n in notes)


def test_only_keeps_the_named_contenders():
    found, notes = gpu_bench.contenders("host", ["gpupool.Pool"])
    assert [c.name for c in found] == ["gpupool.Pool"] and notes == []


def test_gpu_check_needs_a_wheel(tmp_path):
    script = BENCHES / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    done = subprocess.run(
        ["bash", str(script)],
        env={
            "PATH": "/usr/bin:/bin",
            "GPUPOOL_WHEEL": str(tmp_path / "missing.whl"),
            "OUT": str(tmp_path),
        },
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "no gpupool wheel" in done.stderr


gpu_check = bench_scripts.load("gpu_check")


def test_training_runs_must_agree_exactly():
    def run(losses, peak):
        return {"ok": True, "result": {"losses": losses, "peak_reserved_bytes": peak}}

    same = gpu_check.compare_training(run([3.0] * 50, 400), run([3.0] * 50, 300))
    assert same["ok"] and same["max_loss_difference"] == 0.0 and same["peak_reserved_ratio"] == 0.75
    apart = gpu_check.compare_training(run([3.0] * 50, 400), run([3.0] * 49 + [3.5], 300))
    assert not apart["ok"] and apart["max_loss_difference"] == 0.5
    failed = gpu_check.compare_training({"ok": False, "error": "boom"}, run([3.0] * 50, 1))
    assert not failed["ok"] and failed["native"]["error"] == "boom"


def test_bench_ratios_are_against_gpupool():
    timings = [
        {"workload": "w", "contender": "gpupool.Pool", "seconds": [0.001, 0.002, 0.003]},
        {"workload": "w", "contender": "cudaMalloc", "seconds": [0.2, 0.1, 0.3]},
        {"workload": "v", "contender": "cudaMalloc", "seconds": [0.2]},
    ]
    assert gpu_check.bench_ratios(timings) == {"w": {"cudaMalloc": 100.0}}


def test_a_step_reports_its_json_its_failure_or_its_timeout():
    ok = gpu_check.run_step("ok", [sys.executable, "-c", "print('noise'); print('{\"x\": 1}')"], 30)
    assert ok["ok"] and ok["result"] == {"x": 1}
    failed = gpu_check.run_step("failed", [sys.executable, "-c", "import sys; sys.exit('why')"], 30)
    assert not failed["ok"] and "why" in failed["output"]
    slow = gpu_check.run_step("slow", [sys.executable, "-c", "import time; time.sleep(5)"], 0.5)
    assert not slow["ok"] and "timed out" in slow["error"]


def test_without_a_gpu_every_step_says_why(tmp_path):
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["gpu"] is False
    assert set(report["steps"]) == {"tests", "training", "hooks", "bench"}
    assert all("no usable CUDA driver" in step["skipped"] for step in report["steps"].values())


def test_the_steps_run_and_report_on_a_machine_without_frameworks(tmp_path):
    report = gpu_check.check(tmp_path, sys.executable, gpu=True)
    steps = report["steps"]
    assert steps["tests"]["ok"], steps["tests"]  # every gpu test skips here, none fails
    assert steps["hooks"]["ok"] and set(steps["hooks"]["result"]) == {"cupy", "numba"}
    if importlib.util.find_spec("torch") is None:
        assert steps["training"] == {"skipped": "torch is not installed"}
    assert steps["bench"]["ok"] is False and "bench" in steps["bench"]["step"], "cuda:0 is not there"
