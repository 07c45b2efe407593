"""The misuse state machine (tests/misuse_machine.py) for every strategy on host, sim and the
cuda backend over the fake driver, each in a child interpreter: a crash fails one test and shows
the steps that led to it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import fake_driver
import pytest

from pool_checks import EXAMPLES_SCALE, STRATEGIES

MACHINE = Path(__file__).with_name("misuse_machine.py")
# Examples per (device, strategy), about three minutes for all of them on two cores (a cuda
# example costs about three times a host one: its kernels and the fake's checks).
EXAMPLES = {"host": 80, "sim": 80, "cuda": 24}
STEPS = 40
# A fixed seed keeps CI reproducible; `make fuzz` draws fresh ones (GPUPOOL_FUZZ_SEED replays one).
SEED = int(os.environ.get("GPUPOOL_FUZZ_SEED", "0"))


def run_machine(
    device: str,
    strategy: str,
    examples: int,
    seed: int,
    log: Path,
    timeout: float | None = None,
    fake: Path | None = None,
) -> subprocess.CompletedProcess:
    """Runs the machine in a child, on the fake driver built in ``fake`` for the cuda device.
    One that outlives `timeout` is taken to hang: its threads' Python stacks (the child dumps
    them on SIGUSR1) and native stacks (gdb, where present) are appended to its stderr, and it
    is killed (exit -9). By default the limit leaves that time inside pytest-timeout's 300 s
    (an example takes about 0.1 s)."""
    timeout = timeout if timeout is not None else 120 + examples / 4
    env = {**os.environ, "GPUPOOL_MISUSE": f"{device},{strategy},{examples},{STEPS},{log}"}
    if fake is not None:
        env["LD_LIBRARY_PATH"] = str(fake)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(MACHINE)]
    command += [f"--hypothesis-seed={seed}", "-W", "error"]
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = stacks_of_hung(child, log)
        child.kill()
        out, err = child.communicate()
        err += f"\n--- the child hung for {timeout:.0f} s ---\n{stacks}"
    return subprocess.CompletedProcess(command, child.returncode, out, err)


def stacks_of_hung(child: subprocess.Popen, log: Path) -> str:
    """What each thread of a hung child is doing, as far as it can be told."""
    python_stacks = log.with_suffix(".stacks")
    child.send_signal(signal.SIGUSR1)
    time.sleep(2)
    found = [python_stacks.read_text() if python_stacks.exists() else "(no Python stacks)"]
    if shutil.which("gdb"):
        gdb = ["gdb", "-p", str(child.pid), "-batch", "-ex", "thread apply all bt 15"]
        try:
            found.append(subprocess.run(gdb, capture_output=True, text=True, timeout=60, check=False).stdout)
        except subprocess.TimeoutExpired:
            found.append("(gdb timed out)")
    return "\n".join(found)


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    if fake_driver.compiler() is None:
        pytest.skip("no C compiler to build the fake driver")
    return fake_driver.build(tmp_path_factory.mktemp("fake_cuda"))


@pytest.mark.parametrize("device", ["host", "sim", "cuda"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_program_crashes_or_corrupts_a_pool(device, strategy, tmp_path, request):
    log = tmp_path / "steps.log"
    library = request.getfixturevalue("fake") if device == "cuda" else None
    child = run_machine(device, strategy, EXAMPLES[device] * EXAMPLES_SCALE, SEED, log, fake=library)
    if child.returncode < 0 or child.returncode > 1:
        steps = log.read_text() if log.exists() else "(no step log)"
        pytest.fail(f"the child died (exit {child.returncode}) after these steps:\n{steps}\n{child.stderr[-30000:]}")
    assert child.returncode == 0, child.stdout[-8000:] + child.stderr[-2000:]
    assert " passed" in child.stdout, child.stdout
