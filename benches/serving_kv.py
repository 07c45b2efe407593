"""Serving with a KV tensor per request and layer: synthetic traces, replayed with `--min-capacity`.

Usage: python benches/serving_kv.py [--out DIR] [--seeds N]

Continuous batching in which each request owns one contiguous K and one V tensor per layer, sized
to its prompt plus its longest output (as a static cache per request does), allocated when it
joins and freed when it finishes, at a random step. Every step allocates and frees the batch's
activations and logits. Requests join while the KV budget allows. Three model shapes (24, 32 and
16 layers) alternate with the seed. The traces are written as RMM CSVs and replayed like
`gpupool replay FILE --min-capacity`; the table gives each strategy's min capacity and peak live
divided by it. Deterministic: the same seeds give the same traces and figures.

Unlike training steps, the requests' lifetimes are unrelated to each other: a short request's
tensors (under 1 MiB per layer) may sit between a longer request's, and outlive them.
"""

from __future__ import annotations

import argparse
import gzip
import os
import random
import tempfile

from gpupool.trace import load, replay

MiB, GiB = 1 << 20, 1 << 30
STRATEGIES = ("default", "pages", "expandable", "pytorch")
# (layers, hidden size, KV heads) and the KV budget, by seed % 3; heads of 128 in 2-byte floats.
SHAPES = ((24, 2048, 16, 3 * GiB), (32, 2560, 8, 3 * GiB), (16, 2048, 16, 2 * GiB))
HEAD = 128
STEPS = 1500


def serving_trace(seed: int, path: str) -> None:
    """Writes one program's allocations and frees as an RMM CSV (gzip)."""
    rng = random.Random(900 + seed)
    layers, hidden, kv_heads, budget = SHAPES[seed % 3]
    rows: list[str] = []
    live: dict[int, int] = {}
    next_address = 0x10000000

    def alloc(size: float) -> int:
        nonlocal next_address
        size = max(512, -(-int(size) // 512) * 512)
        address = next_address
        next_address += (size + 4095) // 4096 * 4096 + 4096
        live[address] = size
        rows.append(f"0,{len(rows) * 1e-6:.9f},allocate,{hex(address)},{size},0x0")
        return address

    def free(*addresses: int) -> None:
        for address in addresses:
            rows.append(f"0,{len(rows) * 1e-6:.9f},free,{hex(address)},{live.pop(address)},0x0")

    for _ in range(layers):
        alloc(6.5 * hidden * hidden * 2)  # a layer's weights
    alloc(32000 * hidden * 2)  # the embedding
    per_token = layers * 2 * kv_heads * HEAD * 2
    requests: list[list] = []  # [steps left, its tensors, its tokens]
    used = 0
    for _ in range(STEPS):
        while rng.random() < 0.5:
            tokens = rng.randint(64, 2048) + rng.choice([128, 256, 512, 1024])
            if used + tokens * per_token > budget:
                break
            tensors = [alloc(tokens * kv_heads * HEAD * 2) for _ in range(2 * layers)]
            requests.append([rng.randint(10, 300), tensors, tokens])
            used += tokens * per_token
            prefill = tokens // 2  # the prompt's pass: two short-lived activations
            small, large = alloc(prefill * hidden * 2), alloc(prefill * 5.5 * hidden * 2)
            free(large, small)
        if not requests:
            continue
        batch = len(requests)
        hidden_states = alloc(batch * hidden * 2)
        for _ in range(0, layers, 4):
            small, large = alloc(batch * hidden * 2), alloc(batch * 5.5 * hidden * 2)
            free(small, large)
        free(alloc(batch * 32000 * 4), hidden_states)  # logits, then the hidden states
        for request in list(requests):
            request[0] -= 1
            if request[0] <= 0:
                free(*request[1])
                used -= request[2] * per_token
                requests.remove(request)
    free(*list(live))
    with gzip.open(path, "wt") as out:
        out.write("Thread,Time,Action,Pointer,Size,Stream\n" + "\n".join(rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="keep the traces in this folder (default: a temporary one)")
    parser.add_argument("--seeds", type=int, default=10, help="programs 0 .. N-1 (default 10)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.out or scratch
        os.makedirs(folder, exist_ok=True)
        print("| trace | peak live | " + " | ".join(STRATEGIES) + " | default - pages |")
        print("|---|---:|" + "---:|" * (len(STRATEGIES) + 1))
        for seed in range(args.seeds):
            path = os.path.join(folder, f"serving_kv_{seed}.csv.gz")
            serving_trace(seed, path)
            trace = load(path)
            least = {}
            cells = []
            for strategy in STRATEGIES:
                result = replay(trace, f"strategy:{strategy}", min_capacity=True)
                least[strategy] = result.min_capacity_bytes or 0
                cells.append(f"{least[strategy] / MiB:,.0f} MiB ({result.min_capacity_utilization or 0:.2%})")
            gap = (least["default"] - least["pages"]) / MiB
            head = f"| serving_kv_{seed} | {trace.peak_live_bytes / MiB:,.1f} MiB | "
            print(head + " | ".join(cells) + f" | {gap:+,.0f} MiB |")


if __name__ == "__main__":
    main()
