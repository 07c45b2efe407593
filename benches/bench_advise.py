"""How long ``gpupool advise`` takes on a snapshot of a million events over twenty configurations.

The snapshot is generated here, the way PyTorch writes one: a pool with PyTorch's rules runs a
training-like loop (activations of several sizes per layer, freed in reverse in the backward
pass, small tensors, a few big ones), recording begins after a warm-up step, and the result is
pickled in PyTorch's format with recorded settings that differ from the defaults, so that the
advice replays twenty configurations (what ran, fourteen stock PyTorch settings, five gpupool
strategies). The time is wall clock for loading the pickle and advising, median of ``--repeat``,
with the loading alone; then the replays alone on one thread and on one per core; then how fast
a Python loop runs in one thread while another replays the trace natively (as fast as alone:
the replay releases the GIL).

    .venv/bin/python benches/bench_advise.py --events 1000000 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import statistics
import tempfile
import threading
import time

import gpupool
from gpupool import _native
from gpupool._advice import analysis, candidates, settings, start

MiB = 1 << 20


def _step(pool: gpupool.Pool, rng: random.Random, layers: int, held: list) -> int:
    """One training step: forward allocations, backward frees in reverse; returns events made."""
    activations = []
    for _ in range(layers):
        for size in (rng.choice((4, 6, 12, 16, 24)) * MiB, rng.randint(1, 2048) * 512, rng.randint(1, 64) * 4096):
            activations.append(pool.alloc(size))
    # Gradients of a few big parameters live across steps, replaced now and then.
    if held and rng.random() < 0.5:
        held.pop(rng.randrange(len(held))).free()
    held.append(pool.alloc(rng.choice((32, 48, 64)) * MiB))
    for ptr in reversed(activations):
        ptr.free()
    return 2 * len(activations) + 2


def snapshot(events: int, seed: int = 0) -> dict:
    """A PyTorch-format snapshot whose history holds about ``events`` allocations and frees."""
    rng = random.Random(seed)
    pool = gpupool.Pool("sim", capacity="80GiB", config="strategy:pytorch,cross_stream_reuse:never")
    held: list = []
    weights = [pool.alloc(rng.randint(1, 64) * MiB) for _ in range(64)]
    _step(pool, rng, 100, held)
    # Three entries per pair (alloc, free_requested, free_completed), plus segment events.
    pool.record_history(max_entries=2 * events)
    made = 0
    while made < events:
        made += _step(pool, rng, 100, held)
    raw = pool.snapshot()
    raw["allocator_settings"] = {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:96",
        "max_split_size": 96 * MiB,
        "garbage_collection_threshold": 0.0,
        "expandable_segments": False,
    }
    del weights
    return raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "job.pickle")
        with open(path, "wb") as out:
            pickle.dump(snapshot(args.events), out, protocol=pickle.HIGHEST_PROTOCOL)
        times, loads = [], []
        for _ in range(args.repeat):
            began = time.perf_counter()
            [advice] = gpupool.advise_each(path)
            times.append(time.perf_counter() - began)
            began = time.perf_counter()
            analysis.load(path)
            loads.append(time.perf_counter() - began)
        threads = replays_by_threads(path)
        alone, beside = loop_speed(path)
    print(f"gpupool advise: {advice.events:,} events, {len(advice.candidates)} configurations, {os.cpu_count()} cores")
    print(f"median {statistics.median(times):.2f} s of {args.repeat} (min {min(times):.2f}, max {max(times):.2f})")
    print(f"of which loading (unpickle, check entries): median {statistics.median(loads):.2f} s")
    for workers, seconds in threads.items():
        print(f"replays alone on {workers} thread(s): {seconds:.2f} s")
    print(f"a Python loop: {alone / 1e6:.1f} M iterations/s alone, {beside / 1e6:.1f} M/s beside a native replay")


def _native_trace(path: str) -> tuple[_native.Trace, start.StartState, list[candidates.Candidate]]:
    loaded = analysis.load(path)
    record = loaded.devices[0]
    state = start.starting_state(record.rows, record.segments)
    before = [(b.address, b.requested, b.stream) for b in state.blocks]
    trace = _native.Trace.from_snapshot_entries(path, record.rows, before)
    return trace, state, candidates.candidates(settings.from_recorded(loaded.settings).env)


def loop_speed(path: str) -> tuple[float, float]:
    """Iterations per second of a Python loop alone, and while another thread replays."""
    trace = _native_trace(path)[0]
    count, began = 0, time.perf_counter()
    while time.perf_counter() - began < 0.5:
        count += 1
    alone = count / (time.perf_counter() - began)
    done = threading.Event()

    def replay() -> None:
        for _ in range(3):
            _native.replay(trace, "strategy:pytorch")
        done.set()

    worker = threading.Thread(target=replay)
    count, began = 0, time.perf_counter()
    worker.start()
    while not done.is_set():
        count += 1
    beside = count / (time.perf_counter() - began)
    worker.join()
    return alone, beside


def replays_by_threads(path: str) -> dict[int, float]:
    """Seconds the candidates' replays take on one thread and on one per core."""
    trace, state, options = _native_trace(path)
    seconds = {}
    for workers in sorted({1, os.cpu_count() or 1}):
        began = time.perf_counter()
        analysis._replay_all(trace, options, state, None, workers)
        seconds[workers] = time.perf_counter() - began
    return seconds


if __name__ == "__main__":
    main()
