"""`make fuzz`: the misuse state machine and the other property suites, round after round with
fresh seeds, until the time is up.

    python tests/fuzz.py --minutes 60            # fresh seeds; each round prints its seed
    python tests/fuzz.py --seed 1234             # replays one round of a failure's seed

A round runs the misuse machine for every strategy on host, sim and cuda over the fake driver
(each in a child interpreter; cuda where a C compiler builds the fake), the Hypothesis suites
under the "fuzz" profile with the round's seed, the damaged trace loader, and the Rust property
tests with more cases. The first failure stops the run and prints the command that replays it.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS))

import fake_driver  # noqa: E402
from test_misuse import run_machine  # noqa: E402

from pool_checks import STRATEGIES  # noqa: E402

PROPERTY_SUITES = ["test_pool_state_machine.py", "test_streams.py", "test_faults.py", "test_trace_mutants.py"]
# Misuse examples per (device, strategy) and round: about half a minute each.
MISUSE_EXAMPLES = 300


def misuse_round(seed: int, scratch: Path, deadline: float) -> str | None:
    fake = fake_driver.build(scratch / "fake_cuda") if fake_driver.compiler() else None
    for device in ("host", "sim", "cuda") if fake else ("host", "sim"):
        for strategy in STRATEGIES:
            if time.monotonic() > deadline:
                return None
            log = scratch / f"misuse-{device}-{strategy}.log"
            print(f"  misuse {device} strategy:{strategy}", flush=True)
            # A cuda example costs about three times a host one.
            examples = MISUSE_EXAMPLES // 3 if device == "cuda" else MISUSE_EXAMPLES
            child = run_machine(device, strategy, examples, seed, log, timeout=900, fake=fake)
            if child.returncode != 0:
                steps = log.read_text() if log.exists() else ""
                return f"misuse {device} {strategy} (exit {child.returncode}):\n{child.stdout[-6000:]}\n{steps}"
    return None


def property_round(seed: int, deadline: float) -> str | None:
    if time.monotonic() > deadline:
        return None
    env = {**os.environ, "HYPOTHESIS_PROFILE": "fuzz", "GPUPOOL_FUZZ_SEED": str(seed)}
    suites = [str(TESTS / name) for name in PROPERTY_SUITES]
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"--hypothesis-seed={seed}"]
    print("  property suites", flush=True)
    child = subprocess.run([*command, *suites], env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if child.returncode != 0:
        return f"property suites:\n{child.stdout[-6000:]}"
    if time.monotonic() > deadline:
        return None
    print("  rust property tests", flush=True)
    env = {**os.environ, "PROPTEST_CASES": "2000", "PROPTEST_RNG_SEED": str(seed)}
    rust = [
        "cargo",
        "test",
        "--profile",
        "checked",
        "-q",
        "--test",
        "pool_model",
        "--test",
        "stream_model",
        "--test",
        "strategies",
    ]
    child = subprocess.run(rust, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if child.returncode != 0:
        return f"rust property tests:\n{child.stdout[-6000:]}{child.stderr[-2000:]}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--seed", type=int, help="replay one round with this seed")
    args = parser.parse_args()
    deadline = time.monotonic() + args.minutes * 60
    scratch = ROOT / "target" / "fuzz"
    scratch.mkdir(parents=True, exist_ok=True)
    rounds = 0
    while rounds == 0 or (args.seed is None and time.monotonic() < deadline):
        seed = args.seed if args.seed is not None else random.randrange(2**32)
        # A replay runs its whole round; fresh rounds stop where the time runs out.
        stop = float("inf") if args.seed is not None else deadline
        rounds += 1
        print(f"round {rounds}: seed {seed}", flush=True)
        failure = misuse_round(seed, scratch, stop) or property_round(seed, stop)
        if failure:
            print(f"FAILED with seed {seed}: {failure}")
            print(f"replay: make fuzz SEED={seed}  (GPUPOOL_MISUSE_SHRINK=1 shrinks a misuse failure)")
            return 1
    print(f"{rounds} rounds passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
