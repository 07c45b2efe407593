"""Command line: ``gpupool bench`` reruns the seed article's pool-versus-device benchmark here;
``gpupool replay`` replays allocation traces and reports how much memory they need;
``gpupool advise`` says what a PyTorch job really needs, from its memory snapshot."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence

import gpupool
from gpupool import _replay_report
from gpupool._advice import command as _advise_command

MiB = 1 << 20
# The sim device needs a size; this is an 80 GiB accelerator's.
DEFAULT_SIM_CAPACITY = "80GiB"

Allocate = Callable[[int], object]
Release = Callable[[object], None]
# A workload times itself over an allocate/release pair and a list of sizes; returns nanoseconds.
Workload = Callable[[Allocate, Release, Sequence[int]], int]


def _hold_all(allocate: Allocate, release: Release, sizes: Sequence[int]) -> int:
    """Times allocating every size; frees them afterwards, untimed."""
    start = time.perf_counter_ns()
    handles = [allocate(size) for size in sizes]
    elapsed = time.perf_counter_ns() - start
    for handle in handles:
        release(handle)
    return elapsed


def _alloc_free_pairs(allocate: Allocate, release: Release, sizes: Sequence[int]) -> int:
    start = time.perf_counter_ns()
    for size in sizes:
        release(allocate(size))
    return time.perf_counter_ns() - start


def _mixed_sizes(count: int, seed: int = 0) -> list[int]:
    """Log-uniform sizes from 1 KiB to 8 MiB, the same on every run."""
    rng = random.Random(seed)
    return [int(2 ** rng.uniform(10, 23)) for _ in range(count)]


WORKLOADS = (
    ("1000 allocations of 1 MiB", _hold_all, [MiB] * 1000),
    ("1000 alloc+free pairs of 1 MiB", _alloc_free_pairs, [MiB] * 1000),
    ("500 mixed-size allocations", _hold_all, _mixed_sizes(500)),
)


def _time_direct(run: Workload, sizes: Sequence[int], device: str, capacity: str | None) -> int:
    backend = gpupool.Device(device, capacity)
    return run(backend.allocate, backend.release, sizes)


def _time_pool(run: Workload, sizes: Sequence[int], device: str, capacity: str | None) -> int:
    """Times a fresh pool, so the segments it must first obtain from the device count too."""
    pool = gpupool.Pool(device, capacity=capacity)
    return run(pool.alloc, pool.free, sizes)


def bench(device: str, capacity: str | None, repeat: int) -> str:
    """Runs each workload ``repeat`` times both ways; returns a Markdown table of medians."""
    lines = [
        f"gpupool bench: device {device}, repeat {repeat}, median times",
        "",
        "| workload | direct (ms) | pool (ms) | speed-up |",
        "|---|---:|---:|---:|",
    ]
    for name, run, sizes in WORKLOADS:
        direct = statistics.median(_time_direct(run, sizes, device, capacity) for _ in range(repeat))
        pooled = statistics.median(_time_pool(run, sizes, device, capacity) for _ in range(repeat))
        lines.append(f"| {name} | {direct / 1e6:.3f} | {pooled / 1e6:.3f} | {direct / pooled:.1f}x |")
    return "\n".join(lines)


def _run_bench(args: argparse.Namespace) -> None:
    capacity = args.capacity
    if capacity is None and args.device == "sim":
        capacity = DEFAULT_SIM_CAPACITY
    try:
        print(bench(args.device, capacity, args.repeat))
    # A bad capacity, or one too small for the workloads (each holds up to 1000 MiB).
    except (ValueError, gpupool.OutOfMemoryError) as error:
        raise SystemExit(f"gpupool bench: {error}") from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpupool", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    bench_parser = commands.add_parser("bench", help="time the seed article's three workloads, direct versus pooled")
    bench_parser.add_argument("--device", choices=("host", "sim"), default="host")
    bench_parser.add_argument("--capacity", help=f"device size, e.g. 16GiB (sim default: {DEFAULT_SIM_CAPACITY})")
    bench_parser.add_argument("--repeat", type=_positive_int, default=5, help="runs per workload")
    bench_parser.set_defaults(handler=_run_bench)
    _replay_report.add_parser(commands)
    _advise_command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gpupool`` script and of ``python -m gpupool``."""
    args = _parser().parse_args(argv)
    args.handler(args)
    return 0
