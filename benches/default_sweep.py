"""The default strategy on every program BENCHMARKS.md's tables use, for comparing builds.

Usage: python benches/default_sweep.py [--out DIR]

Replays, with `strategy:default` and `--min-capacity`, the three shared traces and the nine
shared snapshots with history (goal 1's rows), the four random-size programs of
`benches/handle_sizes.py`, the five growing-tensor programs of `benches/growing_tensors.py` and
the ten serving programs of `benches/serving_kv.py` (generated here, deterministically), and
prints per program the min capacity and utilization at it, the peak reserved on an unlimited
device and whether it exceeds goal 1's bound (1.01x the min capacity + 20 MiB), and the driver
calls on an unlimited device, on one of 20 times the min capacity and on 80 GiB. The last line
sums the min capacities of each group. Run it under `benches/variant.py` to see what a tuning
constant does:

    python benches/variant.py ROOMY_SHARE=0.75 -- python benches/default_sweep.py
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor

import growing_tensors
import handle_sizes
import serving_kv

from gpupool.trace import load, replay

MiB, GiB = 1 << 20, 1 << 30
SHARED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared")
SNAPSHOTS = ("MAGMA27", "Wedsonlin", "bcrafton", "kkaitlyn111", "notHanmin")


def programs(folder: str) -> list[tuple[str, str]]:
    """(group, path) of every program, the synthetic ones written to `folder`."""
    found = [("shared", p) for p in sorted(glob.glob(os.path.join(SHARED, "traces", "*.csv.gz")))]
    for prefix in SNAPSHOTS:
        found += [("shared", p) for p in sorted(glob.glob(os.path.join(SHARED, "snapshots", f"{prefix}__*.pickle")))]
    for seed in handle_sizes.SHAPES:
        found.append(("random", os.path.join(folder, f"random_sizes_{seed}.csv.gz")))
        handle_sizes.random_sizes_trace(seed, found[-1][1])
    for seed in growing_tensors.SHAPES:
        found.append(("growing", os.path.join(folder, f"kv_cache_{seed}.csv.gz")))
        growing_tensors.kv_cache_trace(seed, found[-1][1])
    for seed in range(10):
        found.append(("serving", os.path.join(folder, f"serving_kv_{seed}.csv.gz")))
        serving_kv.serving_trace(seed, found[-1][1])
    return found


def row(path: str) -> tuple[int, list[int], str]:
    """One program's min capacity in bytes, its driver calls (unlimited, 20x min, 80 GiB) and its
    Markdown row."""
    trace = load(path)
    unlimited = replay(trace, "strategy:default", min_capacity=True)
    least = unlimited.min_capacity_bytes or 0
    over = unlimited.peak_reserved_bytes > 1.01 * least + 20 * MiB
    calls = [replay(trace, "strategy:default", capacity=c).device_calls for c in (20 * least, 80 * GiB)]
    name = os.path.basename(path).split(".")[0][:48]
    cells = [f"{least / MiB:,.0f} MiB ({unlimited.min_capacity_utilization or 0:.2%})"]
    cells += [f"{unlimited.peak_reserved_bytes / MiB:,.0f} MiB{' (over)' if over else ''}"]
    cells += [f"{unlimited.device_calls:,}"] + [f"{c:,}" for c in calls]
    return least, [unlimited.device_calls, *calls], "| " + " | ".join([name, *cells]) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="keep the synthetic programs in this folder (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.out or scratch
        os.makedirs(folder, exist_ok=True)
        found = programs(folder)
        print("| program | min capacity | peak reserved | calls | calls, 20x min | calls, 80 GiB |")
        print("|---|---:|---:|---:|---:|---:|")
        totals: dict[str, int] = {}
        calls = [0, 0, 0]
        with ThreadPoolExecutor(max_workers=2) as pool:
            for (group, _), (least, counts, line) in zip(found, pool.map(row, [p for _, p in found]), strict=True):
                totals[group] = totals.get(group, 0) + least
                calls = [c + n for c, n in zip(calls, counts, strict=True)]
                print(line, flush=True)
        print()
        print("Min capacities summed: " + ", ".join(f"{g} {t / MiB:,.0f} MiB" for g, t in totals.items()))
        print(f"Driver calls summed: unlimited {calls[0]:,}, 20x min {calls[1]:,}, 80 GiB {calls[2]:,}")


if __name__ == "__main__":
    main()
