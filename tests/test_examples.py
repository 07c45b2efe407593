"""The scripts in examples/ run from the repository root and print what their docstrings promise,
and make_snapshot.py still writes the snapshot shipped beside it."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpupool

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SHIPPED = EXAMPLES / "snapshots" / "training_step.pickle"
STAND_INS = Path(__file__).parent / "stand_ins"

# A line each script prints when it worked. The framework hooks print a "skipped" line where the
# framework or a GPU is missing, and their last line otherwise.
EXPECTED = {
    "advise_snapshot.py": r"^recommended\['pytorch'\]: config='[^']*' min_capacity=\d+\.\d\d GiB",
    "pool_numpy.py": r"^after empty_cache: reserved 0 B$",
    "streams.py": r"^the next request got the freed block$",
    "make_snapshot.py": r"^wrote .*: \d+ history entries",
    "torch_hook.py": r"^(skipped: .+|after torch\.cuda\.empty_cache\(\): reserved .+)$",
    "cupy_hook.py": r"^(skipped: .+|after empty_cache\(\): reserved .+)$",
    "numba_hook.py": r"^(skipped: .+|array dropped: allocated .+)$",
}
HOOKS = {"torch_hook.py": "torch", "cupy_hook.py": "cupy", "numba_hook.py": "numba"}


def run(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [sys.executable, f"examples/{script}", *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, f"{script} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_every_example_has_an_expected_line():
    assert sorted(EXPECTED) == sorted(path.name for path in EXAMPLES.glob("*.py"))


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_runs_and_prints_its_line(script, tmp_path):
    # make_snapshot.py would overwrite the shipped snapshot by default.
    args = ("--out", str(tmp_path / "snapshot.pickle")) if script == "make_snapshot.py" else ()
    output = run(script, *args)
    assert re.search(EXPECTED[script], output, re.MULTILINE), f"{script} printed:\n{output}"


@pytest.mark.skipif(gpupool.cuda_available(), reason="a GPU is here: the hooks run for real")
@pytest.mark.parametrize("script", sorted(HOOKS))
def test_a_hook_example_without_a_gpu_skips_where_its_framework_is_installed(script):
    # The stand-ins import as the frameworks do; the check for a GPU must stop the script first.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STAND_INS), str(ROOT / "python")])}
    assert run(script, env=env).splitlines() == ["skipped: no CUDA GPU"]


def test_make_snapshot_writes_the_shipped_snapshot(tmp_path):
    written = tmp_path / "training_step.pickle"
    run("make_snapshot.py", "--out", str(written))
    fresh, shipped = gpupool.advise(written), gpupool.advise(SHIPPED)
    assert fresh.recorded.as_dict() == shipped.recorded.as_dict()
    assert {f: r.as_dict() for f, r in fresh.recommended.items()} == {
        f: r.as_dict() for f, r in shipped.recommended.items()
    }
    assert [c.as_dict() for c in fresh.candidates] == [c.as_dict() for c in shipped.candidates]
    message = "examples/snapshots/training_step.pickle is stale: run python examples/make_snapshot.py"
    assert pickle.loads(written.read_bytes()) == pickle.loads(SHIPPED.read_bytes()), message
    assert written.read_bytes() == SHIPPED.read_bytes(), message


def test_the_shipped_snapshot_reads_as_its_docstring_says():
    advice = gpupool.advise(SHIPPED)
    assert (advice.recorded.empty_cache_calls, advice.recorded.ooms, advice.recorded.ooms_repeated) == (1, 1, 1)
    assert advice.gpu_capacity_bytes == 2 << 30
    assert advice.recorded.segment_decisions_matched == 1.0
    assert advice.history_start > 0, "recording began after blocks were live"
    assert not advice.as_run.fits, "what ran fails on the GPU it had"
    assert all(r.min_capacity_bytes < advice.gpu_capacity_bytes for r in advice.recommended.values())
    assert SHIPPED.stat().st_size < 300_000
