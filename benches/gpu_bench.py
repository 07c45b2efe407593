"""The seed article's three workloads through gpupool and the allocators it competes with.

Workloads: 1000 allocations of 1 MiB (then all freed); 1000 alloc+free pairs of 1 MiB; 500
allocations of mixed sizes (then all freed). Contenders on ``cuda:N``: ``gpupool.Pool``,
``cudaMalloc`` (``gpupool.Device``, every call a driver allocation), ``cudaMallocAsync``
(``gpupool.Device(mode="async")``, the driver's pool), PyTorch's caching allocator
(``torch.cuda.caching_allocator_alloc``) and CuPy's ``MemoryPool``, each absent one skipped with
a note. On ``host`` the script runs gpupool against plain host allocation, so CI can exercise it.

Each contender runs each workload ``--runs`` times after one warm-up (pools start warm, as in a
training loop), contenders interleaved so drift hits all alike; the table gives the median time
per run, per operation, and speed-ups against ``cudaMalloc`` and of gpupool against each.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import gpupool

MiB = 1 << 20
SUBJECT = "gpupool.Pool"
BASELINE = "cudaMalloc"


@dataclass
class Contender:
    name: str
    alloc: Callable[[int], object]
    free: Callable[[object], None]


@dataclass
class Workload:
    name: str
    sizes: list[int]
    # True: allocate everything, then free everything; False: free each allocation at once.
    hold_all: bool

    @property
    def operations(self) -> int:
        return 2 * len(self.sizes)

    def run(self, contender: Contender) -> float:
        """Seconds to run the workload once."""
        alloc, free = contender.alloc, contender.free
        start = time.perf_counter()
        if self.hold_all:
            handles = [alloc(size) for size in self.sizes]
            # Popping drops the last reference inside the timed region (CuPy frees on drop).
            while handles:
                free(handles.pop())
        else:
            for size in self.sizes:
                free(alloc(size))
        return time.perf_counter() - start


def workloads(scale: float = 1.0) -> list[Workload]:
    """The article's workloads; ``scale`` shrinks the counts (and sizes) for quick runs."""
    count = max(1, round(1000 * scale))
    mixed = max(1, round(500 * scale))
    unit = max(4096, round(MiB * min(scale * 4, 1)))
    rng = random.Random(2024)
    # Log-uniform from 1 KiB to 16 MiB: many small tensors, a few large ones.
    mixed_sizes = [round(2 ** rng.uniform(10, 24) * min(scale * 4, 1)) or 1 for _ in range(mixed)]
    return [
        Workload(f"{count} allocations of {unit // 1024} KiB", [unit] * count, hold_all=True),
        Workload(f"{count} alloc+free pairs of {unit // 1024} KiB", [unit] * count, hold_all=False),
        Workload(f"{mixed} mixed-size allocations", mixed_sizes, hold_all=True),
    ]


def _torch(device: str) -> Contender:
    import torch

    ordinal = int(device.split(":")[1])
    torch.cuda.init()
    return Contender(
        "PyTorch caching allocator",
        lambda size: torch.cuda.caching_allocator_alloc(size, device=ordinal),
        torch.cuda.caching_allocator_delete,
    )


def _cupy(device: str) -> Contender:
    import cupy

    cupy.cuda.Device(int(device.split(":")[1])).use()
    pool = cupy.cuda.MemoryPool()
    # Dropping the MemoryPointer returns its block to the pool.
    return Contender("CuPy MemoryPool", pool.malloc, lambda pointer: None)


def contenders(device: str, only: list[str] | None = None) -> tuple[list[Contender], list[str]]:
    """The contenders available for ``device``, and a note for each one that is not."""
    pool = gpupool.Pool(device)
    found = [Contender(SUBJECT, pool.alloc, lambda ptr: ptr.free())]
    notes = []
    if device == "host":
        backend = gpupool.Device("host")
        found.append(Contender("host malloc (gpupool.Device)", backend.allocate, backend.release))
    else:
        makers: list[tuple[str, Callable[[], Contender]]] = [
            (BASELINE, lambda: _device_contender(BASELINE, device, "direct")),
            ("cudaMallocAsync", lambda: _device_contender("cudaMallocAsync", device, "async")),
            ("PyTorch caching allocator", lambda: _torch(device)),
            ("CuPy MemoryPool", lambda: _cupy(device)),
        ]
        for name, make in makers:
            try:
                found.append(make())
            except Exception as e:  # an absent framework or an unsupported driver call
                notes.append(f"{name}: skipped ({type(e).__name__}: {e})")
    if only:
        found = [c for c in found if c.name in only]
    return found, notes


def _device_contender(name: str, device: str, mode: str) -> Contender:
    backend = gpupool.Device(device, mode=mode)
    return Contender(name, backend.allocate, backend.release)


@dataclass
class Result:
    workload: str
    contender: str
    operations: int
    seconds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def measure(work: list[Workload], found: list[Contender], runs: int, notes: list[str]) -> list[Result]:
    """Median-ready timings; a contender that fails a workload is noted and left out of it."""
    results = []
    for w in work:
        row = {c.name: Result(w.name, c.name, w.operations) for c in found}
        for round_ in range(runs + 1):  # round 0 warms up: caches fill, frameworks set up
            for c in found:
                if c.name not in row:
                    continue
                try:
                    seconds = w.run(c)
                except Exception as e:
                    notes.append(f"{c.name} failed '{w.name}': {type(e).__name__}: {e}")
                    del row[c.name]
                    continue
                if round_ > 0:
                    row[c.name].seconds.append(seconds)
        results.extend(row.values())
    return results


def format_table(results: list[Result], subject: str = SUBJECT, baseline: str = BASELINE) -> str:
    """A Markdown table: one row per workload and contender, with the speed-ups."""
    by_key = {(r.workload, r.contender): r for r in results}
    lines = [
        "| workload | allocator | ms per run | µs per op | vs cudaMalloc | gpupool speed-up |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        base = by_key.get((r.workload, baseline))
        mine = by_key.get((r.workload, subject))
        versus_base = f"{base.median / r.median:.1f}x" if base else "-"
        speed_up = f"{r.median / mine.median:.1f}x" if mine and r.contender != subject else "-"
        per_op = r.median / r.operations * 1e6
        lines.append(
            f"| {r.workload} | {r.contender} | {r.median * 1e3:.3f} | {per_op:.3f} | {versus_base} | {speed_up} |"
        )
    return "\n".join(lines)


def verdicts(results: list[Result], subject: str = SUBJECT, baseline: str = BASELINE) -> list[str]:
    """The issue's targets, checked: >= 50x faster than cudaMalloc, faster than each framework pool."""
    by_key = {(r.workload, r.contender): r for r in results}
    lines = []
    for (workload, contender), r in by_key.items():
        mine = by_key.get((workload, subject))
        if mine is None or contender == subject:
            continue
        ratio = r.median / mine.median
        if contender == baseline:
            verdict = "PASS" if ratio >= 50 else "MISS"
            lines.append(f"{verdict} {workload}: {ratio:.1f}x faster than cudaMalloc (target 50x)")
        elif "PyTorch" in contender or "CuPy" in contender:
            verdict = "PASS" if ratio > 1 else "MISS"
            lines.append(f"{verdict} {workload}: {ratio:.2f}x as fast as {contender} (target > 1x)")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda:N or host (default: cuda:0 if usable, else host)")
    parser.add_argument("--runs", type=int, default=7, help="timed runs per workload and contender")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the workloads (0 < scale <= 1)")
    parser.add_argument("--only", nargs="*", help="contender names to keep")
    parser.add_argument("--json", help="also write the raw timings here")
    args = parser.parse_args(argv)
    if args.runs < 1 or not 0 < args.scale <= 1:
        parser.error("--runs must be >= 1 and --scale in (0, 1]")
    if args.device is None:
        args.device = "cuda:0" if gpupool.cuda_available() else "host"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    found, notes = contenders(args.device, args.only)
    results = measure(workloads(args.scale), found, args.runs, notes)
    print(f"gpupool {gpupool.__version__} on {args.device}, median of {args.runs} runs after a warm-up\n")
    print(format_table(results))
    for line in [*notes, *verdicts(results)]:
        print(line)
    if args.json:
        with open(args.json, "w") as out:
            json.dump([vars(r) for r in results], out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
