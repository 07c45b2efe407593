"""The figures of BENCHMARKS.md, in one run: the smallest device each workload runs on under
PyTorch's defaults, PyTorch's expandable segments and gpupool's default strategy, and the cost of
an alloc+free pair against the baselines.

Usage: python benches/report.py [--runs N] [--criterion]

Memory: every workload replays from nothing on a simulated device (the blocks live when
recording began are allocated first), once unlimited and then bisected to the smallest capacity
without an out-of-memory error (to 0.02%), for each configuration. The workloads are the real
traces and the real snapshots with a history beside the repository (../shared), and the example
snapshot in examples/snapshots. Speed: the Python API's alloc+free round trip of 4 KiB on host
memory (gpupool's pool, the seed article's pool, the bare device), medians of interleaved runs;
with --criterion, also `cargo bench --bench pool_pairs` (the core's cached pair against
offset-allocator and range-alloc) read back from target/criterion.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor

import bench_api
import criterion_table

from gpupool.trace import Trace, load, replay

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
CONFIGS = (
    ("PyTorch defaults", "strategy:pytorch"),
    ("expandable_segments:True", "strategy:expandable"),
    ("gpupool default", "strategy:default"),
)
GiB = 1 << 30


def workloads() -> list[pathlib.Path]:
    """The traces, the snapshots that hold a history, and the example snapshot."""
    traces = sorted((SHARED / "traces").glob("*.csv.gz"))
    snapshots = [p for p in sorted((SHARED / "snapshots").glob("*.pickle")) if _has_history(p)]
    example = ROOT / "examples" / "snapshots" / "training_step.pickle"
    return traces + snapshots + ([example] if example.exists() else [])


def _has_history(path: pathlib.Path) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace = load(path, 0)
    return any(e.action == "alloc" for e in trace)


def _load(path: pathlib.Path) -> Trace:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load(path, 0) if path.suffix == ".pickle" else load(path)


def smallest_devices(path: pathlib.Path) -> tuple[int, list[int | None]]:
    """The trace's peak live bytes and each configuration's min capacity."""
    trace = _load(path)
    with ThreadPoolExecutor(max_workers=2) as pool:
        found = list(pool.map(lambda c: replay(trace, c[1], min_capacity=True).min_capacity_bytes, CONFIGS))
    return trace.peak_live_bytes, found


def memory_table(paths: list[pathlib.Path]) -> str:
    head = "| workload | peak live | " + " | ".join(name for name, _ in CONFIGS) + " | default / PyTorch |"
    lines = [head, "|---|" + "---:|" * (len(CONFIGS) + 2)]
    ratios, utilizations = [], {name: [] for name, _ in CONFIGS}
    for path in paths:
        live, needs = smallest_devices(path)
        cells = [f"{n / GiB:.2f} GiB" if n else "-" for n in needs]
        pytorch, default = needs[0], needs[-1]
        ratio = default / pytorch if pytorch and default else None
        ratios += [ratio] if ratio else []
        for (name, _), n in zip(CONFIGS, needs, strict=True):
            if n:
                utilizations[name].append(live / n)
        name = path.name.removesuffix(".pickle").removesuffix(".csv.gz")
        shown = f"{ratio:.3f}" if ratio else "-"
        lines.append(f"| {name} | {live / GiB:.2f} GiB | " + " | ".join(cells) + f" | {shown} |")
    means = [f"{sum(u) / len(u):.1%}" if u else "-" for u in utilizations.values()]
    lines.append("| mean utilization (peak live / min capacity) | | " + " | ".join(means) + " | |")
    return "\n".join(lines)


def speed_table(runs: int) -> str:
    result = bench_api.measure("host", None, 4096, 200_000, runs)
    return bench_api._table(result)


def criterion(groups: list[str]) -> str:
    subprocess.run(["cargo", "bench", "--bench", "pool_pairs", "--", *groups], cwd=ROOT, check=True)
    return "\n\n".join(criterion_table.markdown(group) for group in groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="interleaved runs of the Python round trip")
    parser.add_argument("--criterion", action="store_true", help="also run cargo bench --bench pool_pairs")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    print(f"commit {commit.stdout.strip()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores,")
    print(f"Python {platform.python_version()}")
    print()
    print(memory_table(workloads()))
    print()
    print(speed_table(args.runs))
    if args.criterion:
        print()
        print(criterion(["cached_pair"]))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
