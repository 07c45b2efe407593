"""Writes examples/snapshots/training_step.pickle: the memory snapshot of a small transformer's
training loop on a simulated 2 GiB GPU, for trying ``gpupool advise`` without a GPU or PyTorch.

The loop allocates as PyTorch would: weights once, Adam's two states at the first step, each
layer's activations in the forward pass, gradients in the backward pass, the sequence length
changing from one iteration to the next. Recording begins after a warm-up iteration, so blocks
are live and segments cached before the first entry, as in a real snapshot. Halfway the job
calls ``empty_cache()``; its last iteration, with a larger batch, dies of an out-of-memory error,
and the snapshot is taken in the handler, as a job that dumps its snapshot on failure does. The
batch is one that PyTorch's defaults cannot fit on that GPU and, by advise's replays, other
settings can.

A simulated device takes no time, so each entry's ``time_us`` is a made-up clock (one entry
every 25 us from 2026-01-01): the file is the same bytes on every run.

    python examples/make_snapshot.py [--out PATH]
    gpupool advise examples/snapshots/training_step.pickle
"""

from __future__ import annotations

import argparse
import pathlib
import pickle
import sys

import gpupool

SHIPPED = pathlib.Path(__file__).resolve().parent / "snapshots" / "training_step.pickle"
CAPACITY = "2GiB"
FLOAT = 4
VOCAB, WIDTH, LAYERS, HEADS = 32_000, 512, 6, 8
BATCH, OOM_BATCH = 8, 12
# Tokens per sequence in each iteration; the first is the warm-up, before recording begins.
SEQUENCES = (256, 192, 256, 128, 224, 256)
EMPTY_CACHE_BEFORE = 3
# PyTorch's `allocator_settings` for its defaults, as PyTorch 2.x records them.
PYTORCH_DEFAULTS = {
    "PYTORCH_CUDA_ALLOC_CONF": "",
    "max_split_size": -1,
    "garbage_collection_threshold": 0.0,
    "expandable_segments": False,
    "pinned_num_register_threads": 1,
    "release_lock_on_cudamalloc": False,
    "pinned_use_cuda_host_register": False,
    "roundup_power2_divisions": {str(1 << i): 0 for i in range(16)},
}
START_US, STEP_US = 1_767_225_600_000_000, 25


class Job:
    """A training job's allocations, each remembered with the line that made it (the snapshot's
    stack frames, which ``gpupool advise`` turns into allocation sites)."""

    def __init__(self, pool: gpupool.Pool) -> None:
        self.pool, self.sites, self.site_at = pool, [], {}

    def alloc(self, *shape: int) -> gpupool.DevicePtr:
        caller = sys._getframe(1)
        while caller.f_code.co_name.startswith("<"):  # a comprehension's frame (before Python 3.12)
            caller = caller.f_back
        site = {"filename": "examples/make_snapshot.py", "line": caller.f_lineno, "name": caller.f_code.co_name}
        self.sites.append(site)
        nbytes = FLOAT
        for extent in shape:
            nbytes *= extent
        ptr = self.pool.alloc(nbytes)
        self.site_at[ptr.ptr] = site
        return ptr


def parameters(job: Job) -> list[list[gpupool.DevicePtr]]:
    """The embedding (tied to the output layer), then each layer's matrices, biases and norms."""
    layers = [[job.alloc(VOCAB, WIDTH)]]
    for _ in range(LAYERS):
        attention = [job.alloc(3 * WIDTH, WIDTH), job.alloc(WIDTH, WIDTH)]
        feed_forward = [job.alloc(4 * WIDTH, WIDTH), job.alloc(WIDTH, 4 * WIDTH)]
        # The biases in one tensor and the two norms' scales and shifts in another.
        layers.append([*attention, *feed_forward, job.alloc(9 * WIDTH), job.alloc(4, WIDTH)])
    return layers


def forward(job: Job, batch: int, tokens: int) -> list[list[gpupool.DevicePtr]]:
    """What each layer keeps for the backward pass: the embedding's output, the layers', the logits."""
    saved = [[job.alloc(batch, tokens, WIDTH)]]
    for _ in range(LAYERS):
        norm, qkv = job.alloc(batch, tokens, WIDTH), job.alloc(batch, tokens, 3 * WIDTH)
        scores = job.alloc(batch, HEADS, tokens, tokens)
        probabilities = job.alloc(batch, HEADS, tokens, tokens)
        del scores  # softmax's gradient needs only its output
        attention, projected = job.alloc(batch, tokens, WIDTH), job.alloc(batch, tokens, WIDTH)
        up, activated = job.alloc(batch, tokens, 4 * WIDTH), job.alloc(batch, tokens, 4 * WIDTH)
        saved.append([norm, qkv, probabilities, attention, projected, up, activated, job.alloc(batch, tokens, WIDTH)])
    saved.append([job.alloc(batch, tokens, VOCAB)])
    return saved


def backward(job: Job, saved: list, weights: list, batch: int, tokens: int) -> list[gpupool.DevicePtr]:
    """From the loss back, layer by layer: each layer's gradients made, its activations freed."""
    grad_logits = job.alloc(batch, tokens, VOCAB)
    saved.pop()
    grads = [job.alloc(w.size // FLOAT) for w in weights[0]]
    grad_hidden = job.alloc(batch, tokens, WIDTH)
    del grad_logits
    for layer in reversed(weights[1:]):
        grad_probabilities = job.alloc(batch, HEADS, tokens, tokens)
        grad_up = job.alloc(batch, tokens, 4 * WIDTH)
        grads += [job.alloc(w.size // FLOAT) for w in layer]
        del grad_probabilities, grad_up
        saved.pop()
        grad_hidden = job.alloc(batch, tokens, WIDTH)
    saved.clear()
    del grad_hidden
    return grads


def optimizer_step(job: Job, weights: list, states: list) -> None:
    """Adam: two states per parameter, made at the first step, and a temporary per parameter."""
    flat = [w for layer in weights for w in layer]
    if not states:
        states += [job.alloc(w.size // FLOAT) for w in flat for _ in range(2)]
    for w in flat:
        job.alloc(w.size // FLOAT)


def train(pool: gpupool.Pool) -> dict:
    """Runs the loop and returns the snapshot taken when its last iteration ran out of memory."""
    job, states = Job(pool), []
    weights = parameters(job)
    for iteration, tokens in enumerate(SEQUENCES):
        if iteration == 1:
            pool.record_history(True)
            recorded_from = len(job.sites)
        if iteration == EMPTY_CACHE_BEFORE:
            pool.empty_cache()
        saved = forward(job, BATCH, tokens)
        grads = backward(job, saved, weights, BATCH, tokens)
        optimizer_step(job, weights, states)
        del grads  # zero_grad(set_to_none=True)
    try:
        saved = forward(job, OOM_BATCH, SEQUENCES[-1])
        backward(job, saved, weights, OOM_BATCH, SEQUENCES[-1])
    except gpupool.OutOfMemoryError as error:
        print("last iteration:", str(error).split(". ")[0])
        return snapshot(pool, job, recorded_from)
    raise AssertionError(f"a batch of {OOM_BATCH} fit on {CAPACITY}: raise OOM_BATCH")


def snapshot(pool: gpupool.Pool, job: Job, recorded_from: int) -> dict:
    """The pool's snapshot with PyTorch's recorded defaults, stack frames and the made-up clock.
    Keys and actions are interned, so the pickle writes each once."""
    snap = pool.snapshot()
    snap["allocator_settings"] = PYTORCH_DEFAULTS
    sites = iter(job.sites[recorded_from:])
    entries = [{sys.intern(key): value for key, value in entry.items()} for entry in snap["device_traces"][0]]
    for index, entry in enumerate(entries):
        entry["action"] = sys.intern(entry["action"])
        entry["time_us"] = START_US + STEP_US * index
        if entry["action"] in ("alloc", "oom"):
            entry["frames"] = [next(sites)]
    assert next(sites, None) is None, "every allocation made while recording has an entry"
    snap["device_traces"] = [entries]
    for segment in snap["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                block["frames"] = [job.site_at[block["address"]]]
    return snap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=SHIPPED, help=f"where to write (default {SHIPPED})")
    out = parser.parse_args().out
    pool = gpupool.Pool(device="sim", capacity=CAPACITY, config="strategy:pytorch,cross_stream_reuse:never")
    snap = train(pool)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(pickle.dumps(snap, protocol=4))
    entries = len(snap["device_traces"][0])
    print(f"wrote {out}: {entries} history entries, {out.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
