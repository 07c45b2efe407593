"""Regression tests for misuse that once crashed the interpreter or corrupted a pool (issue 10).

Each case that used to kill the process runs in a child interpreter, so a regression fails one
test with the child's output instead of ending the run.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time

import numpy as np
import pytest

import gpupool
from pool_checks import STRATEGIES, MiB, check_pool

GiB = 1 << 30
ABSURD_SIZES = (800000000 << 30, 1 << 62, 1 << 50, 1 << 40, GiB + 1)


def run_child(code: str) -> str:
    """Runs ``code`` in a fresh interpreter; fails with its output unless it exits cleanly."""
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, check=False
    )
    assert child.returncode == 0, f"child exited with {child.returncode}:\n{child.stdout}\n{child.stderr}"
    return child.stdout


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_absurd_sizes_raise_and_leave_the_pool_intact(strategy):
    out = run_child(
        f"""
        import gpupool
        for device in ("sim", "host"):
            pool = gpupool.Pool(device, capacity="1GiB", config="strategy:{strategy}")
            keep = pool.alloc(3 << 20)
            reserved = pool.memory_reserved()
            for size in {ABSURD_SIZES!r}:
                try:
                    pool.alloc(size)
                except gpupool.OutOfMemoryError as e:
                    assert str(size) in str(e), e
                else:
                    raise AssertionError(f"{{device}}: {{size}} bytes were served")
            try:
                pool.alloc((1 << 62) + 1)
            except ValueError:
                pass
            pool.check_invariants()
            assert pool.memory_reserved() == reserved and pool.device_memory_held() == reserved
            assert pool.memory_stats()["num_ooms"] == len({ABSURD_SIZES!r})
            keep.free()
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_a_request_beyond_the_device_flushes_nothing():
    pool = gpupool.Pool("sim", capacity=GiB, config="strategy:pytorch")
    pool.alloc(MiB).free()
    with pytest.raises(gpupool.OutOfMemoryError):
        pool.alloc(2 * GiB)
    assert pool.memory_reserved() == 2 * MiB, "the cache was emptied for a hopeless request"
    assert pool.memory_stats()["num_alloc_retries"] == 0


def test_a_view_kept_past_free_and_empty_cache_stays_writable():
    out = run_child(
        """
        import numpy as np, gpupool
        pool = gpupool.Pool("host")
        with pool.alloc(8 << 20) as buf:
            view = np.asarray(buf)
            view[:] = 1
        pool.empty_cache()
        view[:] = 2
        assert int(view.sum()) == 2 * (8 << 20)
        print("ok")
        """
    )
    assert out.strip() == "ok"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("export", ["asarray", "view", "dlpack", "capsule"])
def test_exports_pin_their_bytes_until_released(strategy, export):
    pool = gpupool.Pool("host", capacity=256 * MiB, config=f"strategy:{strategy}")
    ptr = pool.alloc(3 * MiB)
    ptr.copy_from_host(b"\x07" * 64)
    if export == "asarray":
        held = np.asarray(ptr)
    elif export == "view":
        held = ptr.view("uint32")
    elif export == "dlpack":
        held = np.from_dlpack(ptr)
    else:
        held = ptr.__dlpack__()
    block = pool.memory_allocated()
    assert ptr.exports == 1
    ptr.free()
    assert ptr.freed
    stats = pool.memory_stats()
    assert stats["allocated_bytes.all.current"] == 0
    assert stats["active_bytes.all.current"] == block, "held bytes count as active"
    pool.empty_cache()
    others = [pool.alloc(3 * MiB) for _ in range(4)]
    for other in others:
        assert other.ptr + other.size <= ptr.ptr or ptr.ptr + ptr.size <= other.ptr, "held bytes were reused"
        other.copy_from_host(b"\xff" * other.size)
    if export != "capsule":
        data = np.asarray(held).view(np.uint8)
        assert (data[:64] == 7).all(), "held bytes changed"
        data[:64] = 9  # writes through an old view land in the held block, nowhere else
        del data
    for other in others:
        assert other.copy_to_host() == b"\xff" * other.size
    check_pool(pool, others, pending=block)
    del held
    assert ptr.exports == 0
    stats = pool.memory_stats()
    assert stats["active_bytes.all.current"] == stats["allocated_bytes.all.current"]
    pool.check_invariants()
    for other in others:
        other.free()
    pool.empty_cache()
    assert pool.memory_reserved() == 0 and pool.device_memory_held() == 0


def test_a_freed_pointer_makes_no_new_exports_and_no_copies():
    pool = gpupool.Pool("host")
    ptr = pool.alloc(4096)
    view = ptr.view("uint8")
    ptr.free()
    for attempt in (lambda: np.asarray(ptr), lambda: ptr.view("uint8"), ptr.__dlpack__, ptr.copy_to_host):
        with pytest.raises(ValueError, match="was freed"):
            attempt()
    with pytest.raises(ValueError, match="double free"):
        ptr.free()
    # The view made before the free still works.
    np.asarray(view)[:] = 3
    assert int(np.asarray(view).sum()) == 3 * 4096


def test_pool_synchronize_completes_every_stream():
    pool = gpupool.Pool("sim", capacity=GiB)
    streams = [pool.stream() for _ in range(3)]
    for s in streams:
        s.hold()
        assert not s.query()
    pool.synchronize()
    assert all(s.query() for s in streams)


@pytest.mark.parametrize("strategy", ["default", "pages", "expandable"])
def test_snapshots_of_paged_strategies_show_mapped_runs(strategy):
    pool = gpupool.Pool("sim", capacity=GiB, config=f"strategy:{strategy},release_threshold:0.0")
    # 40 MiB blocks: the freed one covers whole 20 MiB handles of PyTorch's expandable segments.
    ptrs = [pool.alloc(40 * MiB) for _ in range(4)]
    ptrs[1].free()  # unmapped at once past the watermark: the mapping splits in two runs
    segments = pool.snapshot()["segments"]
    stats = pool.memory_stats()
    assert sum(s["total_size"] for s in segments) == stats["reserved_bytes.all.current"] == pool.memory_reserved()
    assert len(segments) == stats["segment.all.current"] >= 2
    assert all(s["is_expandable"] for s in segments)
    check_pool(pool, [ptrs[0], *ptrs[2:]])


def test_out_of_memory_reports_servable_memory_not_address_space():
    pool = gpupool.Pool("sim", capacity=GiB)
    keep = pool.alloc(100 * MiB)
    with pytest.raises(gpupool.OutOfMemoryError) as e:
        pool.alloc(950 * MiB)
    text = str(e.value)
    largest = text.split("the largest free block is ")[1].split(" (")[0]
    value, unit = largest.split()
    assert unit == "MiB" and float(value) <= 1024 - 100, text
    keep.free()


def _thread_runs_while(call) -> int:
    """How many times the main thread ran during ``call`` in another thread (excluding its edges)."""
    window: list[float] = []

    def worker():
        window.append(time.monotonic())
        call()
        window.append(time.monotonic())

    ticks = []
    thread = threading.Thread(target=worker)
    thread.start()
    while thread.is_alive():
        ticks.append(time.monotonic())
    thread.join()
    start, end = window
    margin = (end - start) * 0.1
    return sum(start + margin < t < end - margin for t in ticks)


DELAY = {"delay": 0.4}


@pytest.mark.parametrize(
    "operation",
    ["alloc", "alloc_cached_map", "free_watermark", "copy_in", "copy_out", "stream_drop", "empty_cache"],
)
def test_device_calls_release_the_gil(operation):
    config = "strategy:default,release_threshold:0.0" if operation == "free_watermark" else "strategy:default"
    slow = gpupool.Pool("host", capacity=256 * MiB, config=config, inject_faults=DELAY)
    if operation == "alloc":
        call = lambda: slow.alloc(MiB)  # noqa: E731
    elif operation == "alloc_cached_map":
        # The range exists; this block needs pages mapped: the "cached" path reaches the device.
        slow.alloc(MiB).free()
        slow.empty_cache()
        call = lambda: slow.alloc(MiB)  # noqa: E731
    elif operation == "free_watermark":
        ptr = slow.alloc(MiB)
        call = ptr.free
    elif operation == "copy_in":
        ptr = slow.alloc(MiB)
        call = lambda: ptr.copy_from_host(b"x" * 1024)  # noqa: E731
    elif operation == "copy_out":
        ptr = slow.alloc(MiB)
        call = ptr.copy_to_host
    elif operation == "stream_drop":
        holder = [slow.stream()]
        call = holder.clear  # the last reference goes: the destructor synchronizes and destroys
    else:
        slow.alloc(MiB).free()
        call = slow.empty_cache
    assert _thread_runs_while(call) >= 10, f"{operation}: the main thread was blocked"
    slow.check_invariants()


def test_a_call_waits_for_a_device_call_that_holds_the_pool():
    """The pool stays locked while a thread is detached for a device call: another thread's call
    waits for it, then sees all of its effect."""
    slow = gpupool.Pool("host", capacity=256 * MiB, inject_faults=DELAY)
    kept = []
    thread = threading.Thread(target=lambda: kept.append(slow.alloc(MiB)))
    thread.start()
    time.sleep(DELAY["delay"] / 4)  # the worker is inside its device call now
    started = time.monotonic()
    assert slow.memory_allocated() == MiB
    assert time.monotonic() - started > DELAY["delay"] / 2
    thread.join()
    slow.check_invariants()


def test_a_failed_free_changes_nothing_and_can_be_retried():
    faults = {"nth": 1, "calls": ["record_event"]}
    pool = gpupool.Pool("sim", capacity=GiB, config="strategy:pytorch", inject_faults=faults)
    side = pool.stream()
    ptr = pool.alloc(MiB)
    ptr.record_stream(side)
    side.hold()
    before = pool.memory_stats()
    with pytest.raises(RuntimeError, match="record_event"):
        ptr.free()
    assert not ptr.freed
    assert pool.memory_stats() == before
    pool.check_invariants()
    ptr.free()
    assert ptr.freed and pool.memory_allocated() == 0
    pool.synchronize()
    pool.check_invariants()


# The failed release is reported as CPython does in destructors.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "faults",
    [
        {"probability": 0.5, "seed": 0, "calls": ["record_event", "synchronize"]},
        {"nth": 1, "effect": "panic", "calls": ["record_event"]},
    ],
)
def test_held_bytes_whose_release_failed_come_back_at_the_next_synchronize(faults):
    pool = gpupool.Pool("host", inject_faults=faults)
    side = pool.stream()
    ptr = pool.alloc(MiB)
    ptr.record_stream(side)
    view = np.asarray(ptr)
    ptr.free()
    del view  # the last export: the device refuses the waits and the synchronize it falls back to
    assert pool.memory_stats()["active_bytes.all.current"] == MiB
    for _ in range(50):  # until the device works again
        try:
            pool.empty_cache()
            break
        except RuntimeError:
            pass
    assert pool.memory_stats()["active_bytes.all.current"] == 0
    assert pool.memory_reserved() == 0 and pool.device_memory_held() == 0
    pool.check_invariants()


# The refused free is reported as CPython does in destructors.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "faults",
    [
        {"nth": 1, "calls": ["record_event"]},
        {"probability": 0.5, "seed": 0, "calls": ["record_event", "synchronize"]},
        {"nth": 1, "effect": "panic", "calls": ["record_event"]},
    ],
)
def test_a_pointer_dropped_while_the_device_refuses_its_free_is_not_leaked(faults):
    # A refused free changes nothing so that it can be retried, but a pointer being destroyed
    # has no one left to retry it: its block stayed allocated for the life of the pool.
    pool = gpupool.Pool("host", inject_faults=faults)
    side = pool.stream()
    ptr = pool.alloc(MiB)
    ptr.record_stream(side)
    side.hold()
    del ptr  # the device refuses the event the free needs on the busy side stream
    for _ in range(50):  # until the device works again
        try:
            pool.empty_cache()
            break
        except RuntimeError:
            pass
    assert pool.memory_allocated() == 0
    assert pool.memory_stats()["active_bytes.all.current"] == 0
    assert pool.memory_reserved() == 0 and pool.device_memory_held() == 0
    pool.check_invariants()


def test_a_forked_child_uses_idle_pools_and_refuses_busy_ones_without_hanging():
    out = run_child(
        """
        import os, threading, time, gpupool
        idle = gpupool.Pool("host")
        kept = idle.alloc(4096)
        kept.copy_from_host(b"k" * 4096)
        busy = gpupool.Pool("host", inject_faults={"delay": 0.5})
        inside = busy.alloc(4096)
        worker = threading.Thread(target=inside.copy_from_host, args=(b"w" * 4096,))
        worker.start()
        time.sleep(0.2)  # the worker holds the busy pool, detached, for its slow copy
        pid = os.fork()
        if pid == 0:
            try:
                busy.alloc(100)
            except RuntimeError as e:
                assert "another thread was inside it" in str(e), e
            assert kept.copy_to_host() == b"k" * 4096
            side = threading.Thread(target=lambda: idle.alloc(1 << 20).free())
            side.start()
            side.join()
            kept.free()
            idle.check_invariants()
            print("child ok", flush=True)
            os._exit(0)
        worker.join()
        deadline = time.monotonic() + 10
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                raise SystemExit("the child hung")
            time.sleep(0.05)
        busy.alloc(100).free()
        print("parent ok")
        """
    )
    assert out.split() == ["child", "ok", "parent", "ok"]


def _is_panic(error: BaseException) -> bool:
    return type(error).__name__ == "PanicException"


def test_a_panic_before_any_change_leaves_a_usable_pool():
    pool = gpupool.Pool("sim", capacity=GiB, config="strategy:pytorch", inject_faults={"nth": 2, "effect": "panic"})
    first = pool.alloc(3 * MiB)
    with pytest.raises(BaseException) as caught:  # noqa: B017 - PanicException derives from BaseException
        pool.alloc(30 * MiB)
    assert _is_panic(caught.value)
    second = pool.alloc(30 * MiB)  # the lock was recovered: the pool's invariants held
    check_pool(pool, [first, second])


# Dropping a pointer of the broken pool reports the error as CPython does in destructors.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_panic_that_left_the_pool_inconsistent_is_reported_by_every_later_call():
    faults = {"nth": 2, "effect": "panic_after"}
    pool = gpupool.Pool("sim", capacity=GiB, config="strategy:pytorch", inject_faults=faults)
    first = pool.alloc(3 * MiB)
    with pytest.raises(BaseException) as caught:  # noqa: B017 - PanicException derives from BaseException
        pool.alloc(30 * MiB)
    assert _is_panic(caught.value)
    for call, args in ((pool.alloc, (MiB,)), (pool.memory_stats, ()), (first.free, ())):
        with pytest.raises(RuntimeError, match="panicked inside it.*device holds"):
            call(*args)
    # Dropped here, under this test's filter: the pointer's destructor reports the same error.
    del first, pool, caught, call
    gc.collect()


def test_the_extension_refuses_to_load_where_the_gil_was_forced_off():
    # The pool's lock is ordered by the GIL (rust/python/gil_lock.rs). A free-threaded Python
    # turns the GIL on for a module that declares it needs it, unless PYTHON_GIL=0 forced it off:
    # `sys._is_gil_enabled()` (3.13+) then says False, which this child pretends.
    out = run_child(
        """
        import sys
        sys._is_gil_enabled = lambda: False
        try:
            import gpupool
        except ImportError as error:
            print("refused:", error)
        else:
            print("loaded")
        """
    )
    assert out.startswith("refused: gpupool needs the GIL, which PYTHON_GIL=0 or -X gil=0 turned off"), out


@pytest.mark.skipif(sysconfig.get_config_var("Py_GIL_DISABLED") != 1, reason="needs a free-threaded Python (3.13t on)")
def test_a_free_threaded_python_turns_the_gil_on_for_gpupool():
    env = {key: value for key, value in os.environ.items() if key != "PYTHON_GIL"}
    code = "import sys, gpupool; print(sys._is_gil_enabled())"
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert child.returncode == 0 and child.stdout.strip() == "True", child.stderr
