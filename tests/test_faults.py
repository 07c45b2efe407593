"""Devices that refuse segments on purpose: failures are OutOfMemoryError, nothing leaks, for
every strategy."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import gpupool
from pool_checks import EXAMPLES_SCALE, RULES, STRATEGIES, MiB, check_pool, drain

SIZES = st.one_of(st.integers(1, 4096), st.integers(1, 24 * MiB))
# ("alloc", size), ("free", which live allocation modulo their number) or ("empty_cache", 0),
# which makes the pool go back to the device, where the faults are.
PROGRAMS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), SIZES),
        st.tuples(st.just("free"), st.integers(0, 1000)),
        st.tuples(st.just("empty_cache"), st.just(0)),
    ),
    min_size=10,
    max_size=80,
)
DEVICES = st.sampled_from([("host", None), ("sim", "64GiB")])


def run_program(pool, program) -> int:
    """Runs the program, checking the pool after every step; returns how many allocations failed."""
    live = []
    failures = 0
    for op, argument in program:
        if op == "alloc":
            try:
                live.append(pool.alloc(argument))
            except gpupool.OutOfMemoryError:
                failures += 1
        elif op == "free" and live:
            live.pop(argument % len(live)).free()
        elif op == "empty_cache":
            pool.empty_cache()
        check_pool(pool, live)
    drain(pool, live)
    return failures


# Examples per strategy, so that all strategies together cost what one did.
EXAMPLES = settings(max_examples=40 * EXAMPLES_SCALE)


@pytest.mark.parametrize("strategy", STRATEGIES)
@EXAMPLES
@given(device=DEVICES, seed=st.integers(0, 2**32 - 1), program=PROGRAMS)
def test_random_refusals_raise_out_of_memory(strategy, device, seed, program):
    kind, capacity = device
    config, faults = f"strategy:{strategy}", {"probability": 0.3, "seed": seed}
    pool = gpupool.Pool(kind, capacity=capacity, config=config, inject_faults=faults)
    failures = run_program(pool, program)
    stats = pool.memory_stats()
    assert stats["num_ooms"] == failures
    # Each failure is a refusal followed by a refused retry.
    assert stats["num_alloc_retries"] >= failures


@pytest.mark.parametrize("strategy", STRATEGIES)
@EXAMPLES
@given(device=DEVICES, nth=st.integers(1, 4), program=PROGRAMS)
def test_one_refusal_is_absorbed_by_the_retry(strategy, device, nth, program):
    kind, capacity = device
    config = f"strategy:{strategy}"
    pool = gpupool.Pool(kind, capacity=capacity, config=config, inject_faults={"nth": nth})
    assert run_program(pool, program) == 0
    stats = pool.memory_stats()
    assert stats["num_ooms"] == 0
    # A refusal is followed by a successful retry, so the nth attempt happened (and was refused)
    # exactly when the pool obtained memory (segments, or mapped pages) at least nth times.
    # Strategies that size segments by what the device has left first back off to the bare
    # request, which needs no retry.
    refused = int(stats["num_device_alloc"] + stats["num_device_map"] >= nth)
    if RULES[strategy].fixed_segments:
        assert stats["num_alloc_retries"] == refused
    else:
        assert stats["num_alloc_retries"] <= refused


@pytest.mark.parametrize("faults", [{"nth": 1, "bogus": 2}, {"probability": 1.5, "seed": 1}, {"nth": 0}])
def test_bad_fault_settings_are_rejected(faults):
    with pytest.raises(ValueError):
        gpupool.Pool("host", inject_faults=faults)
