"""gpupool.torch, gpupool.cupy and gpupool.numba against the fake CUDA driver and stand-ins for the frameworks.

What runs for real: gpupool's C ABI (allocation, free, record_stream, empty_cache), the C++
exception a failed allocation throws, caught the way PyTorch's frames catch it (a small C++
caller built here), and install()'s wiring and configuration. What is stood in for: PyTorch itself
(tests/stand_ins/torch reproduces the interface install() uses, not PyTorch), so that PyTorch
really calls these hooks is checked only on a GPU (benches/gpu_check.sh).
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

import fake_driver
import pytest

MiB = 1 << 20
STAND_INS = Path(__file__).parent / "stand_ins"

pytestmark = pytest.mark.skipif(fake_driver.compiler() is None, reason="no C compiler to build the fake driver")

# Calls a pluggable allocation function the way PyTorch does (through a std::function, inside
# C++ frames that catch exceptions) and reports what came back.
CALLER = r"""
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <new>

extern "C" int call_like_pytorch(void* function, long size, int device, char* out, unsigned long capacity) {
    std::function<void*(long, int, void*)> alloc = reinterpret_cast<void* (*)(long, int, void*)>(function);
    try {
        std::snprintf(out, capacity, "%lu", reinterpret_cast<unsigned long>(alloc(size, device, nullptr)));
        return 0;
    } catch (const std::bad_alloc& e) {
        std::snprintf(out, capacity, "%s", e.what());
        return 1;
    } catch (const std::exception& e) {
        std::snprintf(out, capacity, "%s", e.what());
        return 2;
    }
}
"""


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    return fake_driver.build(tmp_path_factory.mktemp("fake_cuda"))


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    compiler = shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler to build the PyTorch-like caller")
    directory = tmp_path_factory.mktemp("caller")
    (directory / "caller.cpp").write_text(CALLER)
    library = directory / "libcaller.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(directory / "caller.cpp")], check=True)
    return library


def run(parts: tuple[str, ...], fake, **kwargs):
    """Runs the snippet made of ``parts`` (each indented on its own) with the stand-in torch."""
    env = {"PYTHONPATH": str(STAND_INS), **kwargs.pop("env", {})}
    return fake_driver.run("\n".join(textwrap.dedent(part) for part in parts), fake, env=env, **kwargs)


INSTALLED = """
import gpupool.torch
from torch.cuda import memory
lib = ctypes.CDLL(_native.__file__)
installed = memory.current
hooks = installed.allocator().hooks
alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(installed.alloc)
free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(installed.free)
record_stream = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(hooks["set_record_stream_fn"])
empty_cache = ctypes.CFUNCTYPE(None)(hooks["set_reset_fn"])
"""


def test_record_stream_and_empty_cache_reach_the_pool(fake):
    result = run(
        (
            """
        import gpupool.torch
        gpupool.torch.install("strategy:pytorch")
        """,
            INSTALLED,
            """
        use_context()
        side = ctypes.c_void_p()
        assert driver().cuStreamCreate(ctypes.byref(side), 1) == 0
        ptr = alloc(3 * (1 << 20), 0, None)
        record_stream(ptr, side)           # tensor.record_stream(side)
        launch(side.value, ptr, 3 * (1 << 20))
        free(ptr, 3 * (1 << 20), 0, None)
        stats = gpupool.torch.memory_stats(0)
        pending = stats["active_bytes.all.current"] - stats["allocated_bytes.all.current"]
        again = alloc(3 * (1 << 20), 0, None)
        complete(side.value)
        free(again, 3 * (1 << 20), 0, None)
        empty_cache()                      # torch.cuda.empty_cache()
        report(names=[installed.alloc == ctypes.cast(lib.gpupool_torch_alloc, ctypes.c_void_p).value],
               pending=pending, reused=again == ptr, violations=violations(),
               reserved=gpupool.torch.memory_stats(0)["reserved_bytes.all.current"], error=gpupool.torch.last_error())
        """,
        ),
        fake,
    )
    assert result["names"] == [True]
    assert result["pending"] == 3 * MiB, "the free waits for the side stream, as PyTorch's allocator does"
    assert not result["reused"] and result["violations"] == 0
    assert result["reserved"] == 0, "empty_cache returned the cached segment"
    assert result["error"] is None


def test_record_stream_with_another_devices_stream_defers_the_free(fake):
    # tensor.record_stream(s) with s on another GPU: the driver records an event only on a stream
    # of the event's own context, so the fence is made in the side stream's context. The free
    # used to fail there, and PyTorch, which never frees twice, leaked the block.
    result = run(
        (
            """
        import gpupool.torch
        gpupool.torch.install("strategy:pytorch")
        """,
            INSTALLED,
            """
        use_context(1)
        side = ctypes.c_void_p()
        assert driver().cuStreamCreate(ctypes.byref(side), 1) == 0
        ours = use_context(0)
        ptr = alloc(3 * (1 << 20), 0, None)
        record_stream(ptr, side)
        launch(side.value, ptr, 3 * (1 << 20))
        free(ptr, 3 * (1 << 20), 0, None)
        error, context = gpupool.torch.last_error(), current_context() == ours
        stats = gpupool.torch.memory_stats(0)
        pending = stats["active_bytes.all.current"] - stats["allocated_bytes.all.current"]
        again = alloc(3 * (1 << 20), 0, None)
        complete(side.value)
        free(again, 3 * (1 << 20), 0, None)
        third = alloc(3 * (1 << 20), 0, None)
        free(third, 3 * (1 << 20), 0, None)
        stats = gpupool.torch.memory_stats(0)
        # Closing a pool while another device's kernel still uses a freed block: the memory
        # goes back to the driver only after that kernel.
        held = alloc(3 * (1 << 20), 0, None)
        record_stream(held, side)
        launch(side.value, held, 3 * (1 << 20))
        free(held, 3 * (1 << 20), 0, None)
        _native._capi_configure("cuda", "strategy:pytorch")
        complete(side.value)                # a kernel on memory already returned is a violation
        report(error=error, pending=pending, reused=again == ptr, violations=violations(),
               back=third in (ptr, again), active=stats["active_bytes.all.current"], context=context,
               last=gpupool.torch.last_error(), events=calls("cuEventCreate"), destroyed=calls("cuEventDestroy_v2"))
        """,
        ),
        fake,
        device_count=2,
    )
    assert result["error"] is None
    assert result["pending"] == 3 * MiB, "the free waits for the other device's stream"
    assert not result["reused"] and result["violations"] == 0
    assert result["back"] and result["active"] == 0, "once the side stream finished, the block is back in the pool"
    assert result["context"] and result["last"] is None
    assert result["events"] >= 2 and result["destroyed"] == result["events"], "closing the pool destroys every event"


def test_a_refused_free_is_retried_not_leaked(fake):
    # PyTorch frees each address once. When the pool refuses a free (here the driver fails to
    # record the side stream's event), the free has not happened; the C ABI retries it at the
    # device's next call instead of losing the block.
    result = run(
        (
            """
        import os
        import gpupool.torch
        gpupool.torch.install("strategy:pytorch")
        """,
            INSTALLED,
            """
        use_context()
        side = ctypes.c_void_p()
        assert driver().cuStreamCreate(ctypes.byref(side), 1) == 0
        ptr = alloc(3 * (1 << 20), 0, None)
        record_stream(ptr, side)
        launch(side.value, ptr, 3 * (1 << 20))
        os.environ["FAKE_CUDA_FAIL_EVENT_RECORD"] = str(calls("cuEventRecord") + 1)
        free(ptr, 3 * (1 << 20), 0, None)
        error = gpupool.torch.last_error()
        refused = gpupool.torch.memory_stats(0)["allocated_bytes.all.current"]
        other = alloc(1 << 20, 0, None)      # retries the free: now it waits for the side stream
        stats = gpupool.torch.memory_stats(0)
        pending = stats["active_bytes.all.current"] - stats["allocated_bytes.all.current"]
        complete(side.value)
        free(other, 1 << 20, 0, None)
        empty_cache()
        report(error=error, refused=refused, pending=pending, violations=violations(),
               reserved=gpupool.torch.memory_stats(0)["reserved_bytes.all.current"])
        """,
        ),
        fake,
    )
    assert "cuEventRecord" in result["error"]
    assert result["refused"] == 3 * MiB, "the refused free changed nothing"
    assert result["pending"] == 3 * MiB, "the retry waits for the side stream like any free"
    assert result["violations"] == 0
    assert result["reserved"] == 0, "every block came back, so empty_cache returned every segment"


def test_a_refused_free_is_retried_after_its_stream_is_gone(fake):
    # The stream that refused the free's event is destroyed by its owner before the retry: the
    # retry waits for the device instead of recording an event on it.
    result = run(
        (
            """
        import os
        import gpupool.torch
        gpupool.torch.install("strategy:pytorch")
        """,
            INSTALLED,
            """
        use_context()
        side = ctypes.c_void_p()
        assert driver().cuStreamCreate(ctypes.byref(side), 1) == 0
        ptr = alloc(1 << 20, 0, None)
        record_stream(ptr, side)
        os.environ["FAKE_CUDA_FAIL_EVENT_RECORD"] = str(calls("cuEventRecord") + 1)
        free(ptr, 1 << 20, 0, None)
        assert driver().cuStreamDestroy_v2(side) == 0
        free(alloc(1 << 20, 0, None), 1 << 20, 0, None)
        empty_cache()
        stats = gpupool.torch.memory_stats(0)
        report(allocations=stats["allocation.all.current"], reserved=stats["reserved_bytes.all.current"],
               error=gpupool.torch.last_error())
        """,
        ),
        fake,
    )
    assert (result["allocations"], result["reserved"]) == (0, 0), result["error"]


def test_a_failed_allocation_is_thrown_not_returned_as_null(fake, caller):
    result = run(
        (
            """
        import gpupool.torch
        gpupool.torch.install()
        """,
            INSTALLED,
            f"""
        harness = ctypes.CDLL({str(caller)!r})
        out = ctypes.create_string_buffer(8192)
        outcomes = {{}}
        for name, size, device in (("fits", 1 << 20, 0), ("too big", 1 << 40, 0), ("no device", 1 << 20, 5)):
            code = harness.call_like_pytorch(ctypes.c_void_p(installed.alloc), ctypes.c_long(size), device, out, 8192)
            outcomes[name] = [code, out.value.decode()]
        report(outcomes=outcomes)
        """,
        ),
        fake,
        memory=64 * MiB,
    )
    fits, too_big, no_device = (result["outcomes"][k] for k in ("fits", "too big", "no device"))
    assert fits[0] == 0 and int(fits[1]) != 0
    assert too_big[0] == 1, "out of memory is a std::bad_alloc"
    # PyTorch's own message starts so; tools that retry with smaller batches look for it.
    assert too_big[1].startswith("CUDA out of memory. gpupool: out of memory on cuda:0")
    assert "64.00 MiB" in too_big[1], "the report carries the device's capacity"
    assert no_device[0] == 2 and "cuda:5 does not exist" in no_device[1]


# What one allocation asks the driver for: (cuMemAllocAsync, cuMemMap, cuMemAlloc) calls, at most 1.
ASYNC, PAGED, PLAIN = (1, 0, 0), (0, 1, 0), (0, 0, 1)


@pytest.mark.parametrize(
    ("env", "pytorch_env", "calls"),
    [
        ({"GPUPOOL_ALLOC_CONF": "backend:cudaMallocAsync"}, False, ASYNC),
        ({"GPUPOOL_ALLOC_CONF": "strategy:pytorch"}, False, PLAIN),
        ({}, False, PAGED),
        ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, False, PAGED),
        ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, True, ASYNC),
        ({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}, True, ASYNC),
        ({"GPUPOOL_ALLOC_CONF": "strategy:pytorch", "PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}, True, PLAIN),
        # A variable set to nothing is set: PyTorch then reads PYTORCH_ALLOC_CONF (its defaults) and
        # never the deprecated PYTORCH_CUDA_ALLOC_CONF; an empty GPUPOOL_ALLOC_CONF is the defaults.
        ({"PYTORCH_ALLOC_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, True, PAGED),
        ({"GPUPOOL_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}, True, PAGED),
    ],
)
def test_install_reads_the_configuration(fake, env, pytorch_env, calls):
    result = run(
        (
            f"""
        import gpupool.torch
        gpupool.torch.install(pytorch_env={pytorch_env})
        """,
            INSTALLED,
            """
        free(alloc(1 << 20, 0, None), 1 << 20, 0, None)
        report(calls=[min(calls(name), 1) for name in ("cuMemAllocAsync", "cuMemMap", "cuMemAlloc_v2")])
        """,
        ),
        fake,
        env=env,
    )
    assert tuple(result["calls"]) == calls


def test_a_pytorch_without_the_hooks_is_refused(fake):
    result = run(
        (
            """
        import gpupool.torch
        try:
            gpupool.torch.install()
            error = None
        except RuntimeError as e:
            error = str(e)
        report(error=error)
        """,
        ),
        fake,
        env={"STAND_IN_TORCH_WITHOUT_HOOKS": "1"},
    )
    assert "set_record_stream_fn" in result["error"] and "set_reset_fn" in result["error"]


def test_a_memory_fraction_set_in_pytorch_limits_the_pool(fake):
    result = run(
        (
            """
        import gpupool.torch
        gpupool.torch.install("strategy:pytorch")
        """,
            INSTALLED,
            """
        set_fraction = ctypes.CFUNCTYPE(None, ctypes.c_double, ctypes.c_int)(hooks["set_memory_fraction_fn"])
        # The C ABI's null-returning allocation, on the same pools (PyTorch's throws).
        c_alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(
            ctypes.cast(lib.gpupool_alloc, ctypes.c_void_p).value)
        def fits(size):
            ptr = c_alloc(size, 0, None)
            if ptr:
                free(ptr, size, 0, None)
            return bool(ptr)
        before = fits(40 << 20)
        set_fraction(0.5, 0)                # torch.cuda.set_per_process_memory_fraction(0.5, 0)
        empty_cache()
        after, small = fits(40 << 20), fits(20 << 20)
        set_fraction(1.5, 0)
        report(before=before, after=after, small=small, error=gpupool.torch.last_error())
        """,
        ),
        fake,
        memory=64 * MiB,
    )
    assert result["before"] and not result["after"] and result["small"]
    assert "[0, 1]" in result["error"], "an out-of-range fraction is refused and kept as the error"


def test_a_pytorch_without_the_fraction_setter_still_installs(fake):
    result = run(
        (
            """
        import gpupool.torch
        gpupool.torch.install()
        """,
            INSTALLED,
            """
        report(hooks=sorted(hooks))
        """,
        ),
        fake,
        env={"STAND_IN_TORCH_WITHOUT_FRACTION": "1"},
    )
    assert result["hooks"] == ["set_record_stream_fn", "set_reset_fn"]


def test_installing_after_pytorch_initialized_cuda_changes_nothing(fake):
    result = run(
        (
            """
        import gpupool.torch
        from torch.cuda import memory
        _native._capi_configure("cuda", "strategy:pytorch")
        try:
            gpupool.torch.install("strategy:expandable")
            error = None
        except RuntimeError as e:
            error = str(e)
        lib = ctypes.CDLL(_native.__file__)
        alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(
            ctypes.cast(lib.gpupool_alloc, ctypes.c_void_p).value)
        alloc(1 << 20, 0, None)
        report(error=error, swapped=memory.current is not None, maps=calls("cuMemMap"))
        """,
        ),
        fake,
        env={"STAND_IN_TORCH_CUDA_INITIALIZED": "1"},
    )
    assert "initialized CUDA" in result["error"]
    assert not result["swapped"] and result["maps"] == 0, "the earlier configuration (plain segments) stands"


def test_the_cupy_allocator_serves_each_device_on_cupys_stream(fake):
    result = run(
        (
            """
        import cupy
        import gpupool.cupy
        malloc = gpupool.cupy.allocator()
        first = malloc(1 << 20)
        cupy.cuda.Device(1).use()
        use_context(1)
        side = ctypes.c_void_p()
        assert driver().cuStreamCreate(ctypes.byref(side), 1) == 0
        cupy.cuda.Stream(side.value).use()
        second = malloc(1 << 20)
        owner = second.mem.owner
        stream = owner.__cuda_array_interface__["stream"]
        pinned = gpupool.cupy.allocator(gpupool.Pool("cuda:0"))
        try:
            pinned(1 << 20)
            error = None
        except ValueError as e:
            error = str(e)
        pool = owner.device
        del second, owner
        report(devices=[first.mem.device_id, pool], stream=stream == side.value, error=error)
        """,
        ),
        fake,
        device_count=2,
    )
    assert result["devices"] == [0, "cuda:1"] and result["stream"]
    assert "serves cuda:0" in result["error"]


def test_cupy_streams_live_until_the_pool_is_done_with_them(fake):
    # CuPy destroys a stream's handle when the Stream object dies; the pool may still record
    # events on a stream it holds blocks of. The allocator keeps the stream until a sweep.
    result = run(
        (
            """
        import cupy
        import gpupool.cupy
        malloc = gpupool.cupy.allocator()
        use_context()
        def cupy_stream():
            raw = ctypes.c_void_p()
            assert driver().cuStreamCreate(ctypes.byref(raw), 1) == 0
            return cupy.cuda.Stream(raw.value, destroy=lambda ptr: driver().cuStreamDestroy_v2(ctypes.c_void_p(ptr)))
        side = cupy_stream()
        side.use()
        block = malloc(1 << 20)
        del block                           # freed on the side stream: a fence will be recorded there
        cupy.cuda.Stream.null.use()
        del side                            # CuPy would destroy the handle now
        destroyed_at_del = calls("cuStreamDestroy_v2")
        errors = []
        for size in (4 << 20, 8 << 20):    # misses on the null stream: fences for the side stream
            try:
                malloc(size)
            except RuntimeError as e:
                errors.append(str(e))
        other = cupy_stream()
        other.use()
        malloc(1 << 20)                     # a stream not served yet: the sweep lets the side one go
        report(destroyed_at_del=destroyed_at_del, destroyed_after=calls("cuStreamDestroy_v2"), errors=errors,
               violations=violations())
        """,
        ),
        fake,
    )
    assert result["errors"] == [], "the pool used a destroyed stream"
    assert result["destroyed_at_del"] == 0 and result["destroyed_after"] == 1
    assert result["violations"] == 0


def test_cupys_per_thread_default_stream_is_refused(fake):
    result = run(
        (
            """
        import cupy
        import gpupool.cupy
        malloc = gpupool.cupy.allocator()
        cupy.cuda.Stream(2).use()           # cudaStreamPerThread
        try:
            malloc(1 << 20)
            error = None
        except ValueError as e:
            error = str(e)
        report(error=error)
        """,
        ),
        fake,
    )
    assert "per-thread default stream" in result["error"]


def test_cupy_out_of_memory_collects_garbage_then_raises_cupys_error(fake):
    result = run(
        (
            """
        import gc
        import cupy
        import gpupool.cupy
        malloc = gpupool.cupy.allocator(gpupool.Pool("cuda:0", config="strategy:pytorch"))
        gc.disable()
        cycle = [malloc(40 << 20)]
        cycle.append(cycle)
        del cycle                           # unreachable, but only a collection frees it
        after_collection = malloc(40 << 20) is not None
        try:
            malloc(1 << 30)
            caught = None
        except cupy.cuda.memory.OutOfMemoryError as e:
            caught = [isinstance(e, gpupool.OutOfMemoryError), isinstance(e, MemoryError), str(e)]
        report(after_collection=after_collection, caught=caught)
        """,
        ),
        fake,
        memory=64 * MiB,
    )
    assert result["after_collection"]
    cupy_type, memory_error, text = result["caught"]
    assert cupy_type and memory_error
    assert text.startswith("Out of memory allocating 1,073,741,824 bytes") and "gpupool:" in text


def test_the_numba_plugin_reports_the_drivers_memory_figures(fake):
    result = run(
        (
            """
        import gpupool.numba
        from numba import cuda
        manager = gpupool.numba.GpupoolMemoryManager(cuda.context_for(0))
        manager.initialize()
        pointer = manager.memalloc(3 << 20)
        info = manager.get_memory_info()
        pointer.free()
        report(info=list(info), held=manager.pool.device_memory_held(), live=len(manager.allocations))
        """,
        ),
        fake,
        memory=256 * MiB,
    )
    free, total = result["info"]
    assert total == 256 * MiB and free == total - result["held"], "cuMemGetInfo's figures"
    assert result["live"] == 0


def test_the_numba_plugin_keeps_its_pool_across_initializations(fake):
    # Numba calls initialize() whenever it readies the context, and may reset() before it.
    result = run(
        (
            """
        import os
        os.environ["GPUPOOL_ALLOC_CONF"] = "strategy:pytorch"
        import gpupool.numba
        from numba import cuda
        manager = gpupool.numba.GpupoolMemoryManager(cuda.context_for(0))
        manager.reset()
        manager.initialize()
        pool = manager.pool
        pointer = manager.memalloc(1 << 20)
        manager.initialize()
        kept = manager.pool is pool
        handle = list(manager.get_ipc_handle(pointer))
        manager.reset()
        gone = manager.pool is None
        manager.initialize()
        report(kept=kept, handle=handle, gone=gone, fresh=manager.pool is not pool, held=pool.device_memory_held())
        """,
        ),
        fake,
    )
    assert result["kept"] and result["handle"] == ["ipc handle", 1 * MiB]
    assert result["gone"] and result["fresh"] and result["held"] == 0, "a reset empties the pool, then drops it"


def test_numba_frees_wait_for_work_on_blocking_streams(fake):
    result = run(
        (
            """
        import gpupool.numba
        from numba import cuda
        manager = gpupool.numba.GpupoolMemoryManager(cuda.context_for(0))
        manager.initialize()
        use_context()
        side = ctypes.c_void_p()
        assert driver().cuStreamCreate(ctypes.byref(side), 0) == 0   # Numba's streams are blocking
        first = manager.memalloc(2 << 20)
        address = first.device_pointer.value
        launch(side.value, address, 2 << 20)
        first.free()                        # the array dies while its kernel still runs
        second = manager.memalloc(2 << 20)
        reused_early = second.device_pointer.value == address
        complete(side.value)
        second.free()
        third = manager.memalloc(2 << 20)
        reused_later = third.device_pointer.value in (address, second.device_pointer.value)
        report(reused_early=reused_early, reused_later=reused_later, violations=violations())
        """,
        ),
        fake,
    )
    assert not result["reused_early"], "memory went to a new array under a running kernel"
    assert result["reused_later"] and result["violations"] == 0


def test_numba_shared_pages_open_only_on_the_exporting_gpu(fake):
    result = run(
        (
            """
        import os, pickle
        os.environ["GPUPOOL_ALLOC_CONF"] = "shareable_handle:posix_fd"
        import gpupool.numba
        from numba import cuda
        manager = gpupool.numba.GpupoolMemoryManager(cuda.context_for(0))
        manager.initialize()
        received = pickle.loads(pickle.dumps(manager.get_ipc_handle(manager.memalloc(2 << 20))))
        try:
            received.open(cuda.context_for(1))
            error = None
        except ValueError as e:
            error = str(e)
        report(error=error)
        """,
        ),
        fake,
        device_count=2,
    )
    assert "another GPU" in result["error"]


def test_numba_ipc_handles_for_plain_segments_and_a_clear_refusal_for_pages(fake):
    result = run(
        (
            """
        import os
        import gpupool.numba
        from numba import cuda
        outcomes = {}
        for config in ("strategy:pytorch", ""):
            os.environ["GPUPOOL_ALLOC_CONF"] = config
            manager = gpupool.numba.GpupoolMemoryManager(cuda.context_for(0))
            manager.initialize()
            pointer = manager.memalloc(3 << 20)
            try:
                outcomes[config or "default"] = list(manager.get_ipc_handle(pointer))
            except RuntimeError as e:
                outcomes[config or "default"] = str(e)
        plain = gpupool.Pool("cuda:0", config="strategy:pytorch")
        a, b = plain.alloc(1 << 20), plain.alloc(1 << 20)
        raw, offset = _native._ipc_handle(plain, b.ptr)
        report(outcomes=outcomes, prefix=bytes(raw[:7]).decode(), offset=offset, base_offset=b.ptr - a.ptr,
               length=len(raw))
        """,
        ),
        fake,
    )
    assert result["outcomes"]["strategy:pytorch"] == ["ipc handle", 3 * MiB]
    assert "strategy:pytorch" in result["outcomes"]["default"], "paged memory has no CUDA IPC handle"
    assert result["prefix"] == "fakeipc" and result["length"] == 64
    assert result["offset"] == result["base_offset"], "the handle is the segment's, with the block's offset"


# The default backs the block with one handle (the device has room), `pages` with one per 2 MiB
# page: the export carries one descriptor per physical allocation either way.
@pytest.mark.parametrize(("strategy", "least"), [("default", 1), ("pages", 3)])
def test_numba_ipc_through_shareable_handles(fake, strategy, least):
    result = run(
        (
            f"""
        import os, pickle
        os.environ["GPUPOOL_ALLOC_CONF"] = "shareable_handle:posix_fd,strategy:{strategy}"
        import gpupool.numba
        from numba import cuda
        manager = gpupool.numba.GpupoolMemoryManager(cuda.context_for(0))
        manager.initialize()
        pointer = manager.memalloc(5 << 20)
        handle = manager.get_ipc_handle(pointer)
        pages = len(handle.export[1])
        received = pickle.loads(pickle.dumps(handle))  # what another process gets
        opened = received.open(cuda.context_for(0))
        address = opened.device_pointer.value
        unmaps = calls("cuMemUnmap")
        received.close()
        report(pages=pages, exported=calls("cuMemExportToShareableHandle"),
               imported=calls("cuMemImportFromShareableHandle"), unmapped=calls("cuMemUnmap") - unmaps,
               address=address, own=pointer.device_pointer.value, offset=handle.offset, size=opened.size)
        """,
        ),
        fake,
    )
    assert result["pages"] >= least, "one descriptor per physical allocation under the 5 MiB"
    assert result["exported"] == result["imported"] == result["pages"]
    assert result["unmapped"] == result["pages"], "closing unmaps the imported pages"
    assert result["address"] != result["own"], "mapped at an address range of the importer's own"
    assert result["size"] == 5 * MiB


def test_numba_a_stale_ipc_handle_is_refused_not_mapped_to_other_pages(fake):
    # Once the exporter closes a handle's descriptors, a new export can reuse their numbers: the
    # stale handle must not open whatever file has the number now.
    result = run(
        (
            """
        import gc, os, pickle
        os.environ["GPUPOOL_ALLOC_CONF"] = "shareable_handle:posix_fd,strategy:pages"
        import gpupool.numba
        from numba import cuda
        manager = gpupool.numba.GpupoolMemoryManager(cuda.context_for(0))
        manager.initialize()
        first, second = manager.memalloc(4 << 20), manager.memalloc(4 << 20)
        handle = manager.get_ipc_handle(first)
        stale, numbers = pickle.dumps(handle), [page[0] for page in handle.export[1]]
        del handle
        gc.collect()
        fresh = manager.get_ipc_handle(second)
        mapped = mappings()
        try:
            pickle.loads(stale).open(cuda.context_for(0))
            error = None
        except RuntimeError as e:
            error = str(e)
        report(reused=numbers == [page[0] for page in fresh.export[1]], error=error, left=mappings() - mapped)
        """,
        ),
        fake,
    )
    assert result["reused"], "the fresh export took the stale one's descriptor numbers"
    assert "stale" in result["error"] and result["left"] == 0


def test_numba_a_failed_ipc_handle_leaves_no_descriptor_open(fake):
    # The descriptors belong to the handle: if it is never made, nothing else would close them.
    result = run(
        (
            """
        import os
        os.environ["GPUPOOL_ALLOC_CONF"] = "shareable_handle:posix_fd,strategy:pages"
        import gpupool.numba
        from numba import cuda
        from numba.cuda.cudadrv import driver
        manager = gpupool.numba.GpupoolMemoryManager(cuda.context_for(0))
        manager.initialize()
        pointer = manager.memalloc(4 << 20)
        def fail(*args, **kwargs):
            raise OSError("refused")
        def leaked(patch):
            descriptors = len(os.listdir("/proc/self/fd"))
            patch()
            try:
                manager.get_ipc_handle(pointer)
            except OSError:
                pass
            return len(os.listdir("/proc/self/fd")) - descriptors
        identity = leaked(lambda: setattr(manager.context.device, "get_device_identity", fail))
        del manager.context.device.get_device_identity
        handle = leaked(lambda: setattr(driver.IpcHandle, "__init__", fail))
        kept, closed = os.open("/dev/null", os.O_RDONLY), os.open("/dev/null", os.O_RDONLY)
        os.close(closed)
        try:
            gpupool.numba._close_all([closed, kept])
        except OSError:
            pass
        try:
            os.close(kept)
            left_open = True
        except OSError:
            left_open = False
        report(identity=identity, handle=handle, left_open=left_open)
        """,
        ),
        fake,
    )
    assert (result["identity"], result["handle"]) == (0, 0)
    assert not result["left_open"], "one descriptor failing to close leaves the rest open"


def test_numba_a_pointer_from_before_a_reset_never_frees_a_newer_allocation(fake):
    # A MemoryPointer made before a reset may die after the next initialize: its finalizer must
    # find nothing to free, not the entry of a newer allocation that took the same key.
    result = run(
        (
            """
        import gpupool.numba
        from numba import cuda
        manager = gpupool.numba.GpupoolMemoryManager(cuda.context_for(0))
        manager.initialize()
        old = manager.memalloc(1 << 20)
        manager.reset()
        manager.initialize()
        new = manager.memalloc(1 << 20)
        old.free()                          # Numba finalizes the stale pointer
        report(live=len(manager.allocations), allocated=manager.pool.memory_allocated())
        """,
        ),
        fake,
    )
    assert result["live"] == 1 and result["allocated"] == 1 * MiB, "the new array's memory was freed under it"


def test_cupy_out_of_memory_survives_pickling(fake):
    # As CuPy's own error does: process pools and Dask carry a worker's exception back pickled.
    result = run(
        (
            """
        import pickle
        import cupy
        import gpupool.cupy
        malloc = gpupool.cupy.allocator(gpupool.Pool("cuda:0", config="strategy:pytorch"))
        try:
            malloc(1 << 30)
        except cupy.cuda.memory.OutOfMemoryError as e:
            caught = e
        try:
            back = pickle.loads(pickle.dumps(caught))
            outcome = [type(back) is type(caught), str(back) == str(caught), isinstance(back, gpupool.OutOfMemoryError)]
        except Exception as e:
            outcome = repr(e)
        report(outcome=outcome)
        """,
        ),
        fake,
        memory=64 * MiB,
    )
    assert result["outcome"] == [True, True, True]


def test_a_forked_child_leaves_the_c_abis_pools_to_the_parent(fake):
    # A child forked from a process using the hook (a DataLoader worker, say) cannot use the
    # parent's CUDA context, and a parent's thread may have held a pool's lock at the fork:
    # every entry point refuses at once, without a driver call or a wait.
    result = run(
        (
            """
        import os
        _native._capi_configure("cuda", "strategy:pytorch")
        lib = ctypes.CDLL(_native.__file__)
        alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(
            ctypes.cast(lib.gpupool_alloc, ctypes.c_void_p).value)
        free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(
            ctypes.cast(lib.gpupool_free, ctypes.c_void_p).value)
        ptr = alloc(1 << 20, 0, None)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            names = ("cuMemAlloc_v2", "cuMemFree_v2", "cuCtxSynchronize", "cuEventRecord", "cuStreamGetCtx")
            before = sum(calls(name) for name in names)
            served = alloc(1 << 20, 0, None)
            refused = _native._capi_last_error()
            free(ptr, 1 << 20, 0, None)
            try:
                _native._capi_empty_cache()
                emptied = "emptied"
            except RuntimeError as e:
                emptied = str(e)
            try:
                stats = _native._capi_memory_stats(0)
            except RuntimeError as e:
                stats = str(e)
            after = sum(calls(name) for name in names)
            os.write(write, json.dumps([served, refused, emptied, stats, after - before]).encode())
            os._exit(0)
        os.close(write)
        served, refused, emptied, stats, child_calls = json.loads(os.read(read, 4096))
        assert os.waitpid(pid, 0)[1] == 0
        free(ptr, 1 << 20, 0, None)
        report(served=served, refused=refused, emptied=emptied, stats=stats, child_calls=child_calls,
               parent=_native._capi_last_error(), allocated=_native._capi_memory_stats(0)["allocation.all.current"])
        """,
        ),
        fake,
    )
    assert result["served"] is None and "forked" in result["refused"]
    assert "forked" in result["emptied"]
    # Not the empty statistics of a device never used.
    assert isinstance(result["stats"], str) and "forked" in result["stats"]
    assert result["child_calls"] == 0, "the child drove the parent's CUDA context"
    assert result["parent"] is None and result["allocated"] == 0, "the parent's pool is untouched"
