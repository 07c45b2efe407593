"""The GPU check's steps, each in a child process with a time limit, gathered into one JSON report.

Steps: the ``gpu``-marked tests; a short PyTorch training loop (a small transformer, 50 steps)
run with PyTorch's allocator and with gpupool's hook, whose losses must be equal, with peak
reserved bytes for both; the CuPy and Numba hooks; and the seed article's workloads
(benches/gpu_bench.py) as ratios against cudaMalloc, cudaMallocAsync, PyTorch's and CuPy's
pools. A step whose framework or GPU is missing is reported as skipped with the reason, so the
script runs (and is tested) without a GPU. benches/gpu_check.sh installs the wheel and runs this.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# One training run: prints one JSON line with the losses and the peak reserved bytes.
TRAINING = """
import json, os, sys, torch
if sys.argv[1] == "gpupool":
    import gpupool.torch
    gpupool.torch.install()
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
layer = torch.nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, dropout=0.0, batch_first=True)
model = torch.nn.Sequential(torch.nn.Embedding(1000, 128), torch.nn.TransformerEncoder(layer, num_layers=2),
                            torch.nn.Linear(128, 1000)).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
tokens = torch.randint(0, 1000, (32, 65), device="cuda")
losses = []
for step in range(50):
    optimizer.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 1000), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
if sys.argv[1] == "gpupool":
    peak = gpupool.torch.memory_stats(0)["reserved_bytes.all.peak"]
else:
    peak = torch.cuda.max_memory_reserved()
print(json.dumps({"losses": losses, "peak_reserved_bytes": peak}))
"""

HOOKS = """
import json
result = {}
try:
    import cupy, gpupool, gpupool.cupy
    pool = gpupool.Pool("cuda:0")
    cupy.cuda.set_allocator(gpupool.cupy.allocator(pool))
    a = cupy.arange(1 << 20, dtype=cupy.float64)
    result["cupy"] = {"ok": float(a.sum()) == (1 << 20) * ((1 << 20) - 1) / 2,
                      "allocated": pool.memory_allocated()}
except ImportError as e:
    result["cupy"] = {"skipped": str(e)}
try:
    import numpy as np
    from numba import cuda
    import gpupool.numba
    cuda.set_memory_manager(gpupool.numba.GpupoolMemoryManager)
    d = cuda.to_device(np.arange(1 << 20, dtype=np.float32))
    manager = cuda.current_context().memory_manager
    free, total = manager.get_memory_info()
    result["numba"] = {"ok": d.copy_to_host()[-1] == (1 << 20) - 1 and 0 < free <= total,
                       "allocated": manager.pool.memory_allocated()}
except ImportError as e:
    result["numba"] = {"skipped": str(e)}
print(json.dumps(result))
"""


def run_step(name: str, command: list[str], timeout: float, env: dict[str, str] | None = None) -> dict:
    """Runs one step; its last stdout line is JSON when the step reports figures."""
    start = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"step": name, "ok": False, "error": f"timed out after {timeout:.0f} s"}
    step = {"step": name, "ok": done.returncode == 0, "seconds": round(time.monotonic() - start, 1)}
    lines = done.stdout.strip().splitlines()
    try:
        step["result"] = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        step["result"] = None
    if done.returncode != 0 or step["result"] is None:
        step["output"] = (done.stdout[-2000:] + done.stderr[-4000:]).strip()
    return step


def compare_training(native: dict, hooked: dict) -> dict:
    """Whether the two runs' losses are equal, and the two peaks."""
    if not (native.get("ok") and hooked.get("ok")):
        return {"ok": False, "error": "a training run failed", "native": native, "gpupool": hooked}
    a, b = native["result"]["losses"], hooked["result"]["losses"]
    difference = max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
    peak_native = native["result"]["peak_reserved_bytes"]
    peak_gpupool = hooked["result"]["peak_reserved_bytes"]
    return {
        "ok": len(a) == len(b) == 50 and difference == 0.0,
        "max_loss_difference": difference,
        "first_loss": a[0],
        "last_loss": a[-1],
        "peak_reserved_bytes": {"pytorch": peak_native, "gpupool": peak_gpupool},
        "peak_reserved_ratio": peak_gpupool / peak_native if peak_native else None,
    }


def bench_ratios(timings: list[dict], subject: str = "gpupool.Pool") -> dict:
    """Per workload: each contender's median time over gpupool's (above 1: gpupool is faster)."""
    medians: dict[str, dict[str, float]] = {}
    for t in timings:
        seconds = sorted(t["seconds"])
        medians.setdefault(t["workload"], {})[t["contender"]] = seconds[len(seconds) // 2]
    return {
        workload: {name: by[name] / by[subject] for name in by if name != subject}
        for workload, by in medians.items()
        if subject in by
    }


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check(out: Path, python: str, gpu: bool) -> dict:
    """Runs every step (or records why it was skipped) and returns the report."""
    report: dict = {"gpu": gpu, "steps": {}}
    steps = report["steps"]
    if not gpu:
        reason = "no usable CUDA driver and GPU"
        for name in ("tests", "training", "hooks", "bench"):
            steps[name] = {"skipped": reason}
        return report
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestConfigWarning"]
    # Limits that keep the whole check under five minutes with the wheel's installation.
    steps["tests"] = run_step("tests", [*pytest, "-m", "gpu", "-rs", "tests/test_cuda_gpu.py"], 120)
    if has("torch"):
        # Deterministic cuBLAS needs a fixed workspace; then equal losses mean equal arithmetic.
        env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        runs = [run_step(f"training ({a})", [python, "-c", TRAINING, a], 35, env) for a in ("native", "gpupool")]
        steps["training"] = compare_training(*runs)
    else:
        steps["training"] = {"skipped": "torch is not installed"}
    steps["hooks"] = run_step("hooks", [python, "-c", textwrap.dedent(HOOKS)], 25)
    hooks = (steps["hooks"].get("result") or {}).values()
    steps["hooks"]["ok"] = steps["hooks"]["ok"] and all(h.get("ok", True) for h in hooks)
    timings = out / "bench.json"
    bench = [python, "benches/gpu_bench.py", "--device", "cuda:0", "--json", str(timings)]
    steps["bench"] = run_step("bench", bench, 55)
    if steps["bench"]["ok"] and timings.exists():
        steps["bench"]["ratios"] = bench_ratios(json.loads(timings.read_text()))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and the timings")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    import gpupool

    report = check(args.out, sys.executable, gpupool.cuda_available())
    report["gpupool"] = gpupool.__version__
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    failed = [name for name, step in report["steps"].items() if step.get("ok") is False]
    print(json.dumps({"failed": failed, "report": str(args.out / "gpu_check.json")}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
