"""Alloc+free round trip via the Python API: gpupool.Pool, the article's pool, the bare device."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import gpupool
from gpupool._baseline import SimpleMemoryPool
from gpupool.cli import DEFAULT_SIM_CAPACITY


def _round_trip_ns(
    allocate: Callable[[int], object], release: Callable[[object], None], size: int, iterations: int
) -> float:
    start = time.perf_counter_ns()
    for _ in range(iterations):
        release(allocate(size))
    return (time.perf_counter_ns() - start) / iterations


def _contenders(device: str, capacity: str | None):
    """Each contender as (name, allocate, release), built once so construction is not timed."""
    pool = gpupool.Pool(device, capacity=capacity)
    baseline = SimpleMemoryPool()
    backend = gpupool.Device(device, capacity)
    return [
        ("gpupool.Pool", pool.alloc, pool.free),
        ("SimpleMemoryPool (article)", baseline.alloc, baseline.free),
        (f"gpupool.Device {device} (no pool)", backend.allocate, backend.release),
    ]


def measure(device: str, capacity: str | None, size: int, iterations: int, runs: int) -> dict:
    """Median ns per round trip of each contender; runs interleave so drift hits all alike."""
    contenders = _contenders(device, capacity)
    samples: dict[str, list[float]] = {name: [] for name, _, _ in contenders}
    for _ in range(runs):
        for name, allocate, release in contenders:
            samples[name].append(_round_trip_ns(allocate, release, size, iterations))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    pool_ns = medians["gpupool.Pool"]
    return {
        "device": device,
        "size": size,
        "iterations": iterations,
        "runs": runs,
        "median_ns": medians,
        "ratio_to_pool": {name: ns / pool_ns for name, ns in medians.items()},
    }


def _table(result: dict) -> str:
    lines = [
        f"alloc+free round trip of {result['size']} B on {result['device']}: "
        f"median of {result['runs']} runs x {result['iterations']} iterations",
        "",
        "| implementation | ns per round trip | time / gpupool.Pool |",
        "|---|---:|---:|",
    ]
    for name, ns in result["median_ns"].items():
        lines.append(f"| {name} | {ns:.0f} | {result['ratio_to_pool'][name]:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("host", "sim"), default="host")
    parser.add_argument("--capacity", help=f"device size, e.g. 16GiB (sim default: {DEFAULT_SIM_CAPACITY})")
    parser.add_argument("--size", type=int, default=4096, help="bytes per allocation")
    parser.add_argument("--iterations", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    capacity = args.capacity or (DEFAULT_SIM_CAPACITY if args.device == "sim" else None)
    result = measure(args.device, capacity, args.size, args.iterations, args.runs)
    print(json.dumps(result, indent=2) if args.json else _table(result))


if __name__ == "__main__":
    main()
