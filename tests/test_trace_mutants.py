"""Damaged traces: random mutants of the real traces and snapshots in ../shared either load or
raise ValueError, never another exception, a hang or a crash.

The mutants are loaded in a child interpreter that names each one before loading it, so a crash
fails the test with the mutant that caused it. ``python tests/test_trace_mutants.py SEED COUNT``
runs the same loop by hand.
"""

from __future__ import annotations

import gzip
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
FILES = sorted([*SHARED.glob("traces/*.csv.gz"), *SHARED.glob("snapshots/*.pickle")])
SEED = int(os.environ.get("GPUPOOL_FUZZ_SEED", "0"))
# Mutants per file: a few seconds in all on two cores.
COUNT = 12


def mutate(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One random damage to ``data``, described."""
    n = len(data)
    at = rng.randrange(max(n, 1))
    kind = rng.choice(["flip", "truncate", "delete", "duplicate", "insert", "number"])
    if kind == "flip":
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(max(n, 1))
            if i < n:
                out[i] ^= 1 << rng.randrange(8)
        return "flip bits", bytes(out)
    if kind == "truncate":
        return f"truncate at {at}", data[:at]
    span = rng.randint(1, 4096)
    if kind == "delete":
        return f"delete {span} at {at}", data[:at] + data[at + span :]
    if kind == "duplicate":
        return f"duplicate {span} at {at}", data[: at + span] + data[at : at + span] + data[at + span :]
    if kind == "insert":
        return f"insert {span} at {at}", data[:at] + rng.randbytes(span) + data[at:]
    # Numbers are what readers convert: make one absurd.
    digits = [i for i in range(n) if 48 <= data[i] <= 57][:100000]
    if not digits:
        return "no digits", data
    i = rng.choice(digits)
    number = rng.choice([b"-1", b"99999999999999999999999999", b"1e400", b"nan", b"", b"0x10"])
    return f"number at {i} -> {number!r}", data[:i] + number + data[i + 1 :]


def variants(path: Path) -> list[tuple[str, bytes, str]]:
    """The damageable forms of a file: its bytes, and a gzip file's text (re-compressed after)."""
    raw = path.read_bytes()
    forms = [("file", raw, path.name)]
    if path.suffix == ".gz":
        forms.append(("text", gzip.decompress(raw), path.name.removesuffix(".gz")))
    return forms


def run(seed: int, count: int, workdir: Path) -> int:
    import gpupool

    rng = random.Random(seed)
    loaded = refused = 0
    for path in FILES:
        for form, data, name in variants(path):
            for index in range(count):
                what, damaged = mutate(data, rng)
                target = workdir / name
                target.write_bytes(damaged)
                print(f"{path.name} [{form}] #{index}: {what}", flush=True)
                try:
                    gpupool.trace.load(target)
                    loaded += 1
                except ValueError as e:
                    assert str(target) in str(e) or target.name in str(e), f"the error does not name the file: {e}"
                    refused += 1
    print(f"done: {loaded} loaded, {refused} refused with ValueError", flush=True)
    return 0


@pytest.mark.skipif(not FILES, reason="../shared/traces and ../shared/snapshots are not here")
def test_damaged_traces_load_or_raise_value_error(tmp_path):
    child = subprocess.run(
        [sys.executable, __file__, str(SEED), str(COUNT), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    last = child.stdout.strip().splitlines()[-1:] or ["(nothing)"]
    assert child.returncode == 0, f"failed at: {last[0]}\n{child.stderr[-4000:]}"
    assert last[0].startswith("done:"), child.stdout[-2000:]


if __name__ == "__main__":
    seed, count = int(sys.argv[1]), int(sys.argv[2])
    if len(sys.argv) > 3:
        sys.exit(run(seed, count, Path(sys.argv[3])))
    with tempfile.TemporaryDirectory() as scratch:
        sys.exit(run(seed, count, Path(scratch)))
