"""The misuse state machine (tests/misuse_machine.py) for every strategy on host and sim, each in
a child interpreter: a crash fails one test and shows the steps that led to it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pool_checks import EXAMPLES_SCALE, STRATEGIES

MACHINE = Path(__file__).with_name("misuse_machine.py")
# Examples per (device, strategy), about two minutes for all of them on two cores.
EXAMPLES = {"host": 80, "sim": 80}
STEPS = 40
# A fixed seed keeps CI reproducible; `make fuzz` draws fresh ones (GPUPOOL_FUZZ_SEED replays one).
SEED = int(os.environ.get("GPUPOOL_FUZZ_SEED", "0"))


def run_machine(device: str, strategy: str, examples: int, seed: int, log: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPUPOOL_MISUSE": f"{device},{strategy},{examples},{STEPS},{log}"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(MACHINE)]
    command += [f"--hypothesis-seed={seed}", "-W", "error"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=False)


@pytest.mark.parametrize("device", ["host", "sim"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_program_crashes_or_corrupts_a_pool(device, strategy, tmp_path):
    log = tmp_path / "steps.log"
    child = run_machine(device, strategy, EXAMPLES[device] * EXAMPLES_SCALE, SEED, log)
    if child.returncode < 0 or child.returncode > 1:
        steps = log.read_text() if log.exists() else "(no step log)"
        pytest.fail(f"the child died (exit {child.returncode}) after these steps:\n{steps}\n{child.stderr[-4000:]}")
    assert child.returncode == 0, child.stdout[-8000:] + child.stderr[-2000:]
    assert " passed" in child.stdout, child.stdout
