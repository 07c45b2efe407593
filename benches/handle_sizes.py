"""Handle sizes: what the default's handles cost in memory and in driver calls.

Usage: python benches/handle_sizes.py [--out DIR] [FILE ...]

A handle (one `cuMemCreate`) goes back to the device whole or not at all, so its size trades
memory against driver calls. Two tables:

1. Memory. Four synthetic programs of random sizes (log-uniform from 512 B to 64 MiB, 256 MiB,
   1 GiB and 128 MiB) and random lifetimes, the live set held under 800 MiB, 3,000 MiB,
   12,000 MiB and 6,000 MiB, are written as RMM CSVs and replayed like `gpupool replay FILE
   --min-capacity`: each strategy's min capacity and peak live divided by it. Deterministic:
   the same seeds give the same traces and figures.
2. Driver calls by device size, for the four programs and every FILE (RMM CSVs, PyTorch
   snapshot pickles): the default's and PyTorch's expandable segments' calls on an unlimited
   device, on an 80 GiB one, and on devices 20, 4 and 2 times the default's min capacity.
"""

from __future__ import annotations

import argparse
import gzip
import os
import random
import tempfile

from gpupool.trace import load, replay

MiB = 1 << 20
STRATEGIES = ("default", "pages", "expandable", "pytorch")
# (live set cap in MiB, log2 of the largest size) per seed.
SHAPES = {0: (800, 26), 1: (3000, 28), 2: (12000, 30), 3: (6000, 27)}
OPERATIONS = 20000
DEVICES = (("80 GiB", 80 << 30), ("20x min", 20), ("4x min", 4), ("2x min", 2))


def random_sizes_trace(seed: int, path: str) -> None:
    """Writes one program's allocations and frees as an RMM CSV (gzip)."""
    rng = random.Random(10 + seed)
    cap, top = SHAPES[seed]
    rows, live, held, next_address = [], [], 0, 0x10000000
    for _ in range(OPERATIONS):
        if live and (held > cap * MiB or rng.random() < 0.48):
            address, size = live.pop(rng.randrange(len(live)))
            rows.append(f"0,{len(rows) * 1e-6:.9f},free,{hex(address)},{size},0x0")
            held -= size
        else:
            size = int(2 ** rng.uniform(9, top))
            rows.append(f"0,{len(rows) * 1e-6:.9f},allocate,{hex(next_address)},{size},0x0")
            live.append((next_address, size))
            held += size
            next_address += (size + 4095) // 4096 * 4096 + 4096
    for address, size in live:
        rows.append(f"0,{len(rows) * 1e-6:.9f},free,{hex(address)},{size},0x0")
    with gzip.open(path, "wt") as out:
        out.write("Thread,Time,Action,Pointer,Size,Stream\n" + "\n".join(rows) + "\n")


def memory_table(paths: list[str]) -> None:
    print("| trace | peak live | " + " | ".join(STRATEGIES) + " |")
    print("|---|---:|" + "---:|" * len(STRATEGIES))
    for path in paths:
        trace = load(path)
        cells = []
        for strategy in STRATEGIES:
            least = replay(trace, f"strategy:{strategy}", min_capacity=True).min_capacity_bytes
            cells.append(f"{least / MiB:,.0f} MiB ({trace.peak_live_bytes / least:.2%})")
        name = os.path.basename(path).split(".")[0]
        print(f"| {name} | {trace.peak_live_bytes / MiB:,.1f} MiB | " + " | ".join(cells) + " |")


def calls_table(paths: list[str]) -> None:
    print("| trace | default's min | strategy | unlimited | " + " | ".join(name for name, _ in DEVICES) + " |")
    print("|---|---:|---|---:|" + "---:|" * len(DEVICES))
    for path in paths:
        trace = load(path)
        least = replay(trace, "strategy:default", min_capacity=True).min_capacity_bytes
        sizes = [size if size > 100 else size * least for _, size in DEVICES]
        name = os.path.basename(path).split(".")[0][:48]
        for strategy in ("default", "expandable"):
            config = f"strategy:{strategy}"
            # A device smaller than the job is left out: the replay would fail, not count calls.
            calls = [replay(trace, config, size).device_calls if size >= least else None for size in sizes]
            cells = [f"{c:,}" if c is not None else "-" for c in [replay(trace, config).device_calls, *calls]]
            print(f"| {name} | {least / MiB:,.0f} MiB | {strategy} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="keep the random programs in this folder (default: a temporary one)")
    parser.add_argument("files", nargs="*", help="more traces for the driver-call table")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.out or scratch
        os.makedirs(folder, exist_ok=True)
        programs = []
        for seed in SHAPES:
            programs.append(os.path.join(folder, f"random_sizes_{seed}.csv.gz"))
            random_sizes_trace(seed, programs[-1])
        memory_table(programs)
        print()
        calls_table(programs + args.files)


if __name__ == "__main__":
    main()
