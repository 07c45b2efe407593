"""Growing tensors: synthetic KV-cache traces, replayed with `--min-capacity` per strategy.

Usage: python benches/growing_tensors.py [--out DIR]

LLM decoding that grows its KV cache by concatenation: per layer a K and a V tensor, each step
replaced by a copy one token longer (allocated before the old one is freed), three short-lived
activations per step, six requests of random prompt and output lengths one after another, the
weights allocated first. Five programs (seeds 0 to 4, of different layer counts and token sizes)
are written as RMM CSVs and replayed like `gpupool replay FILE --min-capacity`; the table gives
each strategy's min capacity and peak live divided by it. Deterministic: the same seeds give the
same traces and figures.
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
# (layers, bytes per token of one tensor) per seed.
SHAPES = {0: (24, 40960), 1: (24, 40960), 2: (32, 40960), 3: (40, 61440), 4: (48, 81920)}


def kv_cache_trace(seed: int, path: str) -> None:
    """Writes one program's allocations and frees as an RMM CSV (gzip)."""
    rng = random.Random(seed)
    layers, token = SHAPES[seed]
    rows, live, next_address = [], {}, 0x10000000

    def alloc(size: int) -> int:
        nonlocal next_address
        address = next_address
        next_address += (size + 4095) // 4096 * 4096 + 4096
        live[address] = size
        rows.append(f"0,{len(rows) * 1e-6:.9f},allocate,{hex(address)},{size},0x0")
        return address

    def free(address: int) -> None:
        rows.append(f"0,{len(rows) * 1e-6:.9f},free,{hex(address)},{live.pop(address)},0x0")

    alloc(700 * MiB)  # the weights
    for _ in range(6):
        prompt, steps = rng.randint(50, 400), rng.randint(100, 300)
        cache = [alloc(prompt * token) for _ in range(2 * layers)]
        for step in range(steps):
            for i, old in enumerate(cache):
                cache[i] = alloc((prompt + step + 1) * token)
                free(old)
            for activation in [alloc(rng.choice([1, 2, 4]) * (prompt + step) * 1024) for _ in range(3)]:
                free(activation)
        for tensor in cache:
            free(tensor)
    for address in list(live):
        free(address)
    with gzip.open(path, "wt") as out:
        out.write("Thread,Time,Action,Pointer,Size,Stream\n" + "\n".join(rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="keep the traces in this folder (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.out or scratch
        os.makedirs(folder, exist_ok=True)
        print("| trace | events | peak live | " + " | ".join(STRATEGIES) + " |")
        print("|---|---:|---:|" + "---:|" * len(STRATEGIES))
        for seed in SHAPES:
            path = os.path.join(folder, f"kv_cache_{seed}.csv.gz")
            kv_cache_trace(seed, path)
            trace = load(path)
            cells = []
            for strategy in STRATEGIES:
                result = replay(trace, f"strategy:{strategy}", min_capacity=True)
                least = result.min_capacity_bytes or 0
                cells.append(f"{least / MiB:,.0f} MiB ({result.min_capacity_utilization or 0:.2%})")
            head = f"| kv_cache_{seed} | {len(trace):,} | {trace.peak_live_bytes / MiB:,.1f} MiB | "
            print(head + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
