"""Random alloc/free/empty_cache programs on host and sim pools, for every strategy, checked
against a shadow model."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import event, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule

import gpupool
from pool_checks import (
    EXAMPLES_SCALE,
    STRATEGIES,
    Ledger,
    MiB,
    check_pool,
    check_watermark,
    drain,
    growth_bound,
    rules_of,
    stamp,
    verify,
)

# Mostly small requests, as in real workloads; a separate rule for big ones fills the capacity.
SIZES = st.one_of(st.integers(1, 4096), st.integers(1, MiB), st.integers(1, 64 * MiB))
BIG_SIZES = st.integers(16 * MiB, 64 * MiB)


@dataclass
class Allocation:
    ptr: gpupool.DevicePtr
    tag: int


class PoolMachine(RuleBasedStateMachine):
    """One pool and the allocations a program holds on it; subclasses choose device and settings."""

    device = ""
    capacity = 0
    strategy = "pytorch"
    extra_config = ""
    allocations = Bundle("allocations")

    def __init__(self) -> None:
        super().__init__()
        config = ",".join(filter(None, [f"strategy:{self.strategy}", self.extra_config]))
        self.pool = gpupool.Pool(self.device, capacity=self.capacity, config=config)
        self.live: dict[int, Allocation] = {}
        self.tags = itertools.count()
        self.ledger = Ledger()
        # Only host memory can be read and written from Python.
        self.holds_data = self.device == "host"

    @rule(target=allocations, size=SIZES)
    def alloc(self, size: int):
        return self._alloc(size)

    @rule(target=allocations, size=BIG_SIZES)
    def alloc_big(self, size: int):
        return self._alloc(size)

    def _alloc(self, size: int):
        ooms = self.pool.memory_stats()["num_ooms"]
        try:
            ptr = self.pool.alloc(size)
        except gpupool.OutOfMemoryError:
            # After the failed retry no cached segment is left to release, so refusing was right
            # only if new memory for the request really does not fit.
            bound = growth_bound(rules_of(self.pool), size)
            limit = self.capacity * (self.pool.config["per_process_memory_fraction"] or 1.0)
            assert self.pool.memory_reserved() + bound > limit
            assert self.pool.memory_stats()["num_ooms"] == ooms + 1
            event("out of memory")
            return multiple()
        assert ptr.size == size and ptr.device == self.device
        self.ledger.allocated(size)
        allocation = Allocation(ptr, next(self.tags))
        if self.holds_data:
            stamp(ptr, allocation.tag)
        self.live[allocation.tag] = allocation
        return allocation

    @rule(allocation=consumes(allocations), through_pool=st.booleans())
    def free(self, allocation: Allocation, through_pool: bool) -> None:
        if self.holds_data:
            verify(allocation.ptr, allocation.tag)
        if through_pool:
            self.pool.free(allocation.ptr)
        else:
            allocation.ptr.free()
        assert allocation.ptr.freed
        self.ledger.freed(allocation.ptr.size)
        del self.live[allocation.tag]
        check_watermark(self.pool)

    @rule()
    def empty_cache(self) -> None:
        self.pool.empty_cache()
        for segment in self.pool.snapshot()["segments"]:
            assert segment["allocated_size"] > 0, "empty_cache kept a fully free segment"

    @invariant()
    def consistent(self) -> None:
        check_pool(self.pool, [a.ptr for a in self.live.values()], ledger=self.ledger)

    def teardown(self) -> None:
        drain(self.pool, [a.ptr for a in self.live.values()])


class HostPoolMachine(PoolMachine):
    device = "host"
    capacity = 256 * MiB


class SimPoolMachine(PoolMachine):
    device = "sim"
    capacity = 512 * MiB


class SplitCappedSimPoolMachine(SimPoolMachine):
    """Blocks of 32 MiB and more are never split for smaller requests (oversize blocks)."""

    extra_config = "max_split_size_mb:32"


class WatermarkSimPoolMachine(SimPoolMachine):
    """Frees give idle segments back past the watermark; the memory fraction caps the pool."""

    extra_config = "release_threshold:0.25,per_process_memory_fraction:0.75"


class InitialPoolHostPoolMachine(HostPoolMachine):
    """Memory obtained when the pool is made (a segment, or mapped pages): data written to
    blocks carved from it reads back intact, and `empty_cache` gives it back once free."""

    extra_config = "initial_pool_size_mb:48"


# Examples per strategy: the suites together stay within a few minutes on two cores.
for _strategy in STRATEGIES:
    for _machine, _examples, _steps in (
        (HostPoolMachine, 30, 50),
        (SimPoolMachine, 50, 80),
        (SplitCappedSimPoolMachine, 25, 80),
        (WatermarkSimPoolMachine, 25, 80),
        (InitialPoolHostPoolMachine, 15, 50),
    ):
        if _machine is SplitCappedSimPoolMachine and _strategy in ("bfc", "arena"):
            continue  # they refuse a split limit (test_strategies.py)
        _name = _machine.__name__.removesuffix("Machine")
        _case = type(f"{_name}_{_strategy}", (_machine,), {"strategy": _strategy}).TestCase
        _case.settings = settings(max_examples=_examples * EXAMPLES_SCALE, stateful_step_count=_steps)
        globals()[f"Test{_name}_{_strategy}"] = _case
# Module-level names holding a TestCase would be collected a second time.
del _case, _machine
