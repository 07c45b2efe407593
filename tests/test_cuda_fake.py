"""The cuda backend's own code against a fake driver over host memory (tests/fake_cuda).

Allocation, copies, streams and events, the context on each thread, error translation and the C
ABI run for real here; only the driver underneath is simulated. No timing is taken.
"""

from __future__ import annotations

import ctypes.util

import fake_driver
import pytest

MiB = 1 << 20

pytestmark = pytest.mark.skipif(fake_driver.compiler() is None, reason="no C compiler to build the fake driver")


@pytest.fixture(scope="session")
def build_fake(tmp_path_factory):
    """Builds (once per variant) the fake with the given symbols hidden."""
    built = {}

    def build(*hidden: str):
        if hidden not in built:
            built[hidden] = fake_driver.build(tmp_path_factory.mktemp("fake_cuda"), hidden)
        return built[hidden]

    return build


@pytest.fixture(scope="session")
def fake(build_fake):
    return build_fake()


def test_pool_round_trip_caches_driver_allocations(fake):
    result = fake_driver.run(
        """
        pool = gpupool.Pool(config="strategy:pytorch")
        ptrs = [pool.alloc(1000 + i) for i in range(50)]
        ptrs[7].copy_from_host(b"gpupool" * 100, offset=3)
        data = ptrs[7].copy_to_host()
        big = pool.alloc(3 * (1 << 20))
        del ptrs, big
        pool.check_invariants()
        held = pool.device_memory_held()
        pool.empty_cache()
        report(
            available=gpupool.cuda_available(), count=gpupool.device_count(), device=pool.device,
            data=data[3:10].decode(), allocs=calls("cuMemAlloc_v2"), held=held,
            after_empty=pool.device_memory_held(), frees=calls("cuMemFree_v2"),
        )
        """,
        fake,
        device_count=2,
    )
    assert result["available"] and result["count"] == 2
    assert result["device"] == "cuda:0"
    assert result["data"] == "gpupool"
    assert result["allocs"] == 2, "50 small requests share one 2 MiB segment; 3 MiB gets a large one"
    assert result["held"] == 2 * MiB + 20 * MiB
    assert result["after_empty"] == 0 and result["frees"] == 2


def test_a_forked_child_refuses_the_parents_cuda_pool(fake):
    result = fake_driver.run(
        """
        import gc, os
        pool = gpupool.Pool("cuda")
        ptr = pool.alloc(100)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                pool.alloc(100)
                message = "served"
            except RuntimeError as e:
                message = str(e)
            before = calls("cuCtxSynchronize") + calls("cuMemFree_v2")
            del ptr, pool
            gc.collect()  # the destructors leave the parent's memory to the parent
            after = calls("cuCtxSynchronize") + calls("cuMemFree_v2")
            os.write(write, json.dumps([message, after - before]).encode())
            os._exit(0)
        os.close(write)
        message, child_calls = json.loads(os.read(read, 4096))
        assert os.waitpid(pid, 0)[1] == 0
        ptr.free()
        pool.check_invariants()
        report(message=message, child_calls=child_calls)
        """,
        fake,
    )
    assert "made before this process forked: CUDA memory cannot be used" in result["message"]
    assert result["child_calls"] == 0


def test_a_forked_child_never_calls_the_driver(fake):
    # CUDA does not survive a fork: any driver call in the child is undefined (the fake counts
    # each as a violation). A bare Device and imported pages have no pool to refuse the child,
    # and their destructors ran in it; an explicit call gets an error that says why.
    result = fake_driver.run(
        """
        import gc, os
        device = gpupool.Device("cuda")
        device.allocate(1 << 20)
        pool = gpupool.Pool("cuda:0", config="strategy:pages,shareable_handle:posix_fd")
        ptr = pool.alloc(2 << 20)
        pid, pages, offset = _native._export_pages(pool, ptr.ptr, 2 << 20)
        imported = _native._import_pages(0, pid, pages)
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            before = violations()
            try:
                imported.close()
                message = "closed"
            except RuntimeError as e:
                message = str(e)
            del device, imported
            gc.collect()
            os.write(write, json.dumps([message, violations() - before]).encode())
            os._exit(0)
        os.close(write)
        message, child_violations = json.loads(os.read(read, 4096))
        assert os.waitpid(child, 0)[1] == 0
        imported.close()
        for fd, *_ in pages:
            os.close(fd)
        report(message=message, child_violations=child_violations, violations=violations())
        """,
        fake,
    )
    assert "forked" in result["message"]
    assert result["child_violations"] == 0, "the child called the driver"
    assert result["violations"] == 0, "the parent's pages and device were disturbed"


def test_copies_outside_an_allocation_are_refused(fake):
    result = fake_driver.run(
        """
        ptr = gpupool.Pool("cuda").alloc(100)
        errors = []
        for offset in (0, 99, 100):
            try:
                ptr.copy_from_host(b"xy", offset=offset)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        report(errors=errors)
        """,
        fake,
    )
    ok, edge, outside = result["errors"]
    assert ok is None and "do not fit" in edge and "do not fit" in outside


def test_out_of_memory_is_translated(fake):
    result = fake_driver.run(
        """
        pool = gpupool.Pool("cuda:0")
        try:
            pool.alloc(100 << 20)
            error = None
        except gpupool.OutOfMemoryError as e:
            error = str(e)
        small = pool.alloc(1 << 20)
        direct = gpupool.Device("cuda:0")
        try:
            direct.allocate(100 << 20)
            direct_error = None
        except gpupool.OutOfMemoryError as e:
            direct_error = str(e)
        report(error=error, ooms=pool.memory_stats()["num_ooms"], direct_error=direct_error)
        """,
        fake,
        memory=64 * MiB,
    )
    assert "out of memory on cuda:0" in result["error"]
    assert "64.00 MiB" in result["error"], "the capacity comes from cuMemGetInfo"
    assert result["ooms"] == 1
    assert "refused" in result["direct_error"]


def test_capacity_caps_a_cuda_pool(fake):
    result = fake_driver.run(
        """
        pool = gpupool.Pool("cuda:0", capacity="16MiB")
        kept = pool.alloc(1 << 20)
        try:
            pool.alloc(20 << 20)
            refused = False
        except gpupool.OutOfMemoryError:
            refused = True
        report(refused=refused)
        """,
        fake,
    )
    assert result["refused"]


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="a real CUDA driver is installed")
def test_missing_driver_is_a_clear_error():
    result = fake_driver.run(OPEN_AND_REPORT, None)
    assert result["error"].startswith("no CUDA driver found")
    assert not result["available"] and result["count"] == 0
    assert result["default"] == "host"


OPEN_AND_REPORT = """
try:
    gpupool.Pool("cuda:0")
    error = None
except RuntimeError as e:
    error = str(e)
report(error=error, available=gpupool.cuda_available(), count=gpupool.device_count(),
       default=gpupool.Pool().device)
"""


def test_old_driver_is_named(fake):
    result = fake_driver.run(OPEN_AND_REPORT, fake, driver_version=11040)
    assert "too old" in result["error"] and "11.4" in result["error"] and "12.0" in result["error"]
    assert not result["available"] and result["default"] == "host"


def test_failing_init_is_reported(fake):
    result = fake_driver.run(OPEN_AND_REPORT, fake, init_error=100)
    assert "CUDA_ERROR_NO_DEVICE" in result["error"]
    assert result["count"] == 0


@pytest.mark.parametrize("status", [36, 919, 5000])
def test_a_status_the_bindings_do_not_name_is_reported_by_number(fake, status):
    # CUDA 13 drivers return statuses CUDA 12.8's bindings lack (36, 919); printing one as the
    # bindings' enum crashed the interpreter.
    result = fake_driver.run(OPEN_AND_REPORT, fake, init_error=status)
    assert result["error"] == f"the CUDA driver failed to start: cuInit failed with CUDA error {status}"
    assert not result["available"]


def test_a_stub_driver_is_named(fake):
    # The toolkit's lib64/stubs/libcuda.so answers every call with CUDA_ERROR_STUB_LIBRARY (34).
    result = fake_driver.run(OPEN_AND_REPORT, fake, init_error=34)
    assert "stub libcuda" in result["error"] and "LD_LIBRARY_PATH" in result["error"]
    assert not result["available"] and result["default"] == "host"


def test_missing_core_symbol_is_named(build_fake):
    result = fake_driver.run(OPEN_AND_REPORT, build_fake("cuMemGetInfo_v2"))
    assert "lacks cuMemGetInfo_v2" in result["error"]
    assert not result["available"]


def test_missing_async_symbol_only_disables_async_mode(build_fake):
    result = fake_driver.run(
        """
        pool = gpupool.Pool("cuda:0")
        pool.alloc(10)
        try:
            gpupool.Device("cuda:0", mode="async")
            error = None
        except RuntimeError as e:
            error = str(e)
        report(error=error)
        """,
        build_fake("cuMemAllocAsync"),
    )
    assert "lacks cuMemAllocAsync" in result["error"]


def test_importing_pages_without_virtual_memory_calls_is_an_error(build_fake):
    result = fake_driver.run(
        """
        import os
        try:
            _native._import_pages(0, os.getpid(), [(0, 2 << 20, 0, 0)])
            error = None
        except RuntimeError as e:
            error = str(e)
        report(error=error)
        """,
        build_fake("cuMemAddressReserve"),
    )
    assert "lacks cuMemAddressReserve" in result["error"]


def test_device_numbers_and_modes(fake):
    result = fake_driver.run(
        """
        errors = {}
        for spec in ("cuda:2", "cuda:x", "cuda:-1"):
            try:
                gpupool.Pool(spec)
            except (RuntimeError, ValueError) as e:
                errors[spec] = type(e).__name__ + ": " + str(e)
        try:
            gpupool.Device("host", mode="async")
        except ValueError as e:
            errors["host async"] = str(e)
        report(errors=errors, second=gpupool.Pool("cuda:1").device)
        """,
        fake,
        device_count=2,
    )
    errors = result["errors"]
    assert errors["cuda:2"].startswith("RuntimeError") and "does not exist" in errors["cuda:2"]
    assert errors["cuda:x"].startswith("ValueError") and errors["cuda:-1"].startswith("ValueError")
    assert "mode" in errors["host async"]
    assert result["second"] == "cuda:1"


def test_direct_and_async_devices_call_the_driver_every_time(fake):
    result = fake_driver.run(
        """
        direct = gpupool.Device("cuda:0")
        addresses = [direct.allocate(4096) for _ in range(3)]
        for a in addresses:
            direct.release(a)
        stream_ordered = gpupool.Device("cuda:0", mode="async")
        for _ in range(4):
            stream_ordered.release(stream_ordered.allocate(1 << 20))
        try:
            direct.release(addresses[0])
            double = None
        except Exception as e:
            double = type(e).__name__
        report(allocs=calls("cuMemAlloc_v2"), frees=calls("cuMemFree_v2"),
               async_allocs=calls("cuMemAllocAsync"), async_frees=calls("cuMemFreeAsync"), double=double)
        """,
        fake,
    )
    assert (result["allocs"], result["frees"]) == (3, 3)
    assert (result["async_allocs"], result["async_frees"]) == (4, 4)
    assert result["double"] == "ValueError"


def test_the_cuda_malloc_async_backend_hands_every_request_to_the_driver_pool(fake):
    result = fake_driver.run(
        """
        pool = gpupool.Pool("cuda:0", config="backend:cudaMallocAsync")
        ptrs = [pool.alloc(4096) for _ in range(10)]
        del ptrs
        pool.empty_cache()
        report(async_allocs=calls("cuMemAllocAsync"), async_frees=calls("cuMemFreeAsync"),
               allocs=calls("cuMemAlloc_v2"))
        """,
        fake,
    )
    # As PyTorch's backend:cudaMallocAsync: no caching in gpupool, the driver's pool does it.
    assert (result["async_allocs"], result["async_frees"], result["allocs"]) == (10, 10, 0)


def test_another_devices_stream_is_fenced_from_its_own_context(fake):
    # Events are made in the side stream's context (the driver records an event only on a stream
    # of its own context); closing the pool waits for them before memory goes back.
    result = fake_driver.run(
        """
        use_context(1)
        raw = ctypes.c_void_p()
        assert driver().cuStreamCreate(ctypes.byref(raw), 1) == 0
        pool = gpupool.Pool("cuda:0")
        side = pool.external_stream(raw.value)
        ptr = pool.alloc(3 << 20)
        pool.record_stream(ptr, side)
        launch(raw.value, ptr.ptr, 3 << 20)
        ptr.free()
        again = pool.alloc(3 << 20)
        moved = again.ptr != ptr.ptr
        again.free()
        del ptr, again
        async_pool = gpupool.Pool("cuda:0", config="backend:cudaMallocAsync")
        try:
            async_pool.alloc(4096, stream=async_pool.external_stream(raw.value))
            refused = None
        except RuntimeError as e:
            refused = str(e)
        del pool, side                      # the kernel on the side stream is waited for first
        report(moved=moved, violations=violations(), refused=refused, events=calls("cuEventCreate"),
               destroyed=calls("cuEventDestroy_v2"), allocs=calls("cuMemAllocAsync"))
        """,
        fake,
        device_count=2,
    )
    assert result["moved"], "the block stayed pending while the other device's kernel ran"
    assert result["violations"] == 0, "memory went back under the other device's kernel"
    assert "another device's context" in result["refused"] and result["allocs"] == 0
    assert result["events"] >= 1 and result["destroyed"] == result["events"]


def test_allocations_outlive_the_stream_they_were_made_on(fake):
    # A pointer keeps its Stream alive, so a temporary one is not forgotten under it; a stream
    # destroyed on purpose hands its allocations, held ones included, to the default stream.
    # Each used to fail every free and copy ("stream 1 does not exist") and leak.
    result = fake_driver.run(
        """
        pool = gpupool.Pool("cuda:0")
        ptr = pool.alloc(1 << 20, stream=pool.stream())
        ptr.copy_from_host(b"kept")
        data = ptr.copy_to_host(size=4).decode()
        own = ptr.__cuda_array_interface__["stream"] not in (None, 1)
        ptr.free()
        side = pool.stream()
        other, held = pool.alloc(1 << 20, stream=side), pool.alloc(1 << 20, stream=side)
        view = held.view("u1")
        held.free()
        side.destroy()
        other.copy_from_host(b"moved")
        streams = [other.__cuda_array_interface__["stream"], view.__cuda_array_interface__["stream"]]
        view.__dlpack__(stream=1)
        other.free()
        del ptr, other, held, view
        pool.empty_cache()
        report(data=data, own=own, streams=streams, allocated=pool.memory_allocated(),
               held=pool.device_memory_held())
        """,
        fake,
    )
    assert result["data"] == "kept" and result["own"], "ordered on its own stream while that lives"
    assert result["streams"] == [1, 1], "then on the legacy default stream, as the protocol spells it"
    assert (result["allocated"], result["held"]) == (0, 0)


def test_an_external_stream_is_not_forgotten_under_its_allocations(fake):
    # gpupool never destroys an external stream: its owner may go on using it. A temporary
    # wrapper lives as long as the pointer's bytes are out: the free lets it go, and forgetting
    # it waits for the owner's work first, so the block passes to the default stream only once
    # the kernel that wrote it has finished. Destroying a wrapper that still has allocations is
    # refused, so a block never passes to a stream that does not see the owner's work.
    result = fake_driver.run(
        """
        use_context(0)
        raw = ctypes.c_void_p()
        assert driver().cuStreamCreate(ctypes.byref(raw), 1) == 0
        pool = gpupool.Pool("cuda:0")
        ptr = pool.alloc(1 << 20, stream=pool.external_stream(raw.value))
        launch(raw.value, ptr.ptr, 1 << 20, 0x11)
        waited_before = calls("cuStreamSynchronize")
        ptr.free()
        waited = calls("cuStreamSynchronize") - waited_before
        again = pool.alloc(1 << 20)
        reused = again.ptr == ptr.ptr
        launch(0, again.ptr, 1 << 20, 0x22)
        complete(0)
        wrapper = pool.external_stream(raw.value)
        live = pool.alloc(1 << 20, stream=wrapper)
        try:
            wrapper.destroy()
            refused = None
        except ValueError as e:
            refused = str(e)
        live.free()
        wrapper.destroy()
        report(reused=reused, waited=waited, violations=violations(), refused=refused)
        """,
        fake,
    )
    assert result["waited"] == 1, "the free forgot the wrapper, after waiting for the owner's stream"
    assert result["reused"] and result["violations"] == 0
    assert "still has allocations" in result["refused"]


def test_a_kept_freed_pointer_does_not_keep_a_destroyed_stream_in_use(fake):
    # A user keeps a freed pointer, drops the wrapper of the owner's stream, and the owner
    # destroys that stream: the pool must not ask the driver about it again.
    result = fake_driver.run(
        """
        use_context(0)
        raw = ctypes.c_void_p()
        assert driver().cuStreamCreate(ctypes.byref(raw), 1) == 0
        pool = gpupool.Pool("cuda:0")
        side = pool.external_stream(raw.value)
        kept = pool.alloc(1 << 20, stream=side)
        launch(raw.value, kept.ptr, 1 << 20, 0x11)
        kept.free()
        del side
        assert driver().cuStreamDestroy_v2(ctypes.c_void_p(raw.value)) == 0
        again = pool.alloc(1 << 20)
        pool.synchronize()
        again.free()
        pool.empty_cache()
        del kept
        report(violations=violations(), reserved=pool.memory_reserved())
        """,
        fake,
    )
    assert result == {"violations": 0, "reserved": 0}


def test_a_held_block_released_during_a_capture_waits_for_its_end(fake):
    # The last export of a freed pointer goes while a stream that used it captures: recording
    # its event there would invalidate the capture, so the block waits for a synchronize after it.
    result = fake_driver.run(
        """
        use_context(0)
        pool = gpupool.Pool("cuda:0")
        side = pool.stream()
        ptr = pool.alloc(1 << 20)
        pool.record_stream(ptr, side)
        capsule = ptr.__dlpack__(stream=None)
        ptr.free()
        assert driver().cuStreamBeginCapture_v2(side.handle, 0) == 0   # global mode
        del capsule
        held = pool.memory_stats()["active_bytes.all.current"]
        graph = ctypes.c_void_p()
        end = driver().cuStreamEndCapture(side.handle, ctypes.byref(graph))
        pool.synchronize()
        report(end=end, held=held, active=pool.memory_stats()["active_bytes.all.current"])
        """,
        fake,
    )
    assert result["end"] == 0, "the capture was invalidated"
    assert result["held"] == 1 << 20 and result["active"] == 0


def test_events_on_another_devices_streams_are_all_destroyed(fake):
    result = fake_driver.run(
        """
        use_context(1)
        raw = ctypes.c_void_p()
        assert driver().cuStreamCreate(ctypes.byref(raw), 1) == 0
        use_context(0)
        pool = gpupool.Pool("cuda:0")
        own, foreign = pool.stream(), pool.external_stream(raw.value)
        for _ in range(5):
            for stream, handle in ((own, own.handle), (foreign, raw.value)):
                p = pool.alloc(1 << 20)
                pool.record_stream(p, stream)
                launch(handle, p.ptr, 1 << 20)
                p.free()
                pool.synchronize()
        del p, own, foreign, stream, pool
        report(created=calls("cuEventCreate"), destroyed=calls("cuEventDestroy_v2"), violations=violations())
        """,
        fake,
        device_count=2,
    )
    assert result["created"] > 5 and result["destroyed"] == result["created"]
    assert result["violations"] == 0


def test_another_devices_context_outlives_its_owners_release_until_the_pool_closes(fake):
    # PyTorch or CuPy may release device 1's primary context while the pool still holds events
    # recorded there (released to zero, a context dies with its streams and events). The pool
    # retains it itself, once for all its streams, and releases it at close, after those events
    # and after freeing all of its own memory. It used to leave its memory to the driver then.
    result = fake_driver.run(
        """
        device, context = ctypes.c_int(), ctypes.c_void_p()
        assert gpupool.device_count() == 2 and driver().cuDeviceGet(ctypes.byref(device), 1) == 0
        assert driver().cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
        assert driver().cuCtxSetCurrent(context) == 0
        raws = [ctypes.c_void_p(), ctypes.c_void_p()]
        for raw in raws:
            assert driver().cuStreamCreate(ctypes.byref(raw), 1) == 0
        assert driver().cuCtxSetCurrent(None) == 0
        pool = gpupool.Pool("cuda:0")
        sides = [pool.external_stream(raw.value) for raw in raws]
        kept = pool.alloc(1 << 20)
        ptr = pool.alloc(3 << 20)
        for side in sides:
            pool.record_stream(ptr, side)
        assert driver().cuCtxSetCurrent(context) == 0
        launch(raws[0].value, ptr.ptr, 3 << 20)           # the free's event there stays pending
        assert driver().cuCtxSetCurrent(None) == 0
        ptr.free()
        retains = driver().fake_cuda_primary_retains(1)
        assert driver().cuCtxSetCurrent(context) == 0     # the owner is done with device 1
        for raw in raws:
            assert driver().cuStreamDestroy_v2(raw) == 0
        assert driver().cuCtxSetCurrent(None) == 0
        assert driver().cuDevicePrimaryCtxRelease_v2(device) == 0
        again = pool.alloc(3 << 20)
        again.copy_from_host(b"still works")
        data = again.copy_to_host(size=11).decode()
        held = driver().fake_cuda_used(0)
        del ptr, again, kept, side, sides, pool
        report(retains=retains, data=data, held=held, used=driver().fake_cuda_used(0),
               after=driver().fake_cuda_primary_retains(1), violations=violations(),
               created=calls("cuEventCreate"), destroyed=calls("cuEventDestroy_v2"))
        """,
        fake,
        device_count=2,
    )
    assert result["data"] == "still works" and result["held"] > 0
    assert result["used"] == 0, "the pool's device memory leaked at close"
    assert result["violations"] == 0
    assert result["retains"] == 2, "one retain of device 1's context for both streams, beside its owner's"
    assert result["after"] == 0, "the pool's retain of device 1's context was not released"
    assert result["created"] >= 2 and result["destroyed"] == result["created"]


def test_closing_frees_the_pools_memory_when_another_devices_context_was_reset(fake):
    # cudaDeviceReset on device 1 kills its primary context however many retain it, and the
    # events the pool recorded there with it. Closing skips those events and still frees the
    # pool's own memory; it used to stop at the first one and leave all of it to the driver.
    result = fake_driver.run(
        """
        use_context(1)
        raw, device = ctypes.c_void_p(), ctypes.c_int()
        assert driver().cuStreamCreate(ctypes.byref(raw), 1) == 0
        use_context(0)
        pool = gpupool.Pool("cuda:0")
        side = pool.external_stream(raw.value)
        ptr = pool.alloc(3 << 20)
        pool.record_stream(ptr, side)
        use_context(1)
        launch(raw.value, ptr.ptr, 3 << 20)
        ptr.free()
        assert driver().cuDeviceGet(ctypes.byref(device), 1) == 0
        assert driver().cuDevicePrimaryCtxReset_v2(device) == 0
        use_context(0)
        held = driver().fake_cuda_used(0)
        del ptr, side, pool
        report(held=held, used=driver().fake_cuda_used(0), violations=violations())
        """,
        fake,
        device_count=2,
    )
    assert result["held"] > 0 and result["used"] == 0, "the pool's device memory leaked at close"
    assert result["violations"] == 0


def test_a_stream_of_a_context_made_with_cu_ctx_create_is_refused(fake):
    # Such a context cannot be retained, and one its creator destroys leaves handles the driver
    # does not check: the import is refused with the way out instead.
    result = fake_driver.run(
        """
        gpupool.device_count()
        device, context, raw = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
        assert driver().cuDeviceGet(ctypes.byref(device), 1) == 0
        assert driver().cuCtxCreate_v2(ctypes.byref(context), 0, device) == 0
        assert driver().cuStreamCreate(ctypes.byref(raw), 1) == 0
        pool = gpupool.Pool("cuda:0")
        try:
            pool.external_stream(raw.value)
            error = None
        except RuntimeError as e:
            error = str(e)
        pool.alloc(1 << 20).free()
        report(error=error, retains=driver().fake_cuda_primary_retains(1), current=current_context() == context.value)
        """,
        fake,
        device_count=2,
    )
    assert "cuCtxCreate" in result["error"] and "primary context" in result["error"]
    assert result["retains"] == 0, "the retain taken to compare contexts was kept"
    assert result["current"], "the caller's context was not restored"


def test_every_thread_gets_the_context(fake):
    result = fake_driver.run(
        """
        import threading
        pool = gpupool.Pool("cuda:0")
        errors = []
        def work():
            try:
                for _ in range(20):
                    p = pool.alloc(3 << 20)
                    p.copy_from_host(b"x" * 16)
                    pool.empty_cache()
                    del p
            except Exception as e:
                errors.append(repr(e))
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads: t.start()
        for t in threads: t.join()
        report(errors=errors, binds=calls("cuCtxSetCurrent"))
        """,
        fake,
    )
    assert result["errors"] == []
    assert result["binds"] >= 5, "the opening thread and each worker thread bind the context"


def test_streams_and_events_reach_the_driver(fake):
    result = fake_driver.run(
        """
        pool = gpupool.Pool("cuda:0")
        side = pool.stream()
        ptr = pool.alloc(4096, stream=side)
        cai = ptr.__cuda_array_interface__
        pool.record_stream(ptr, pool.default_stream)
        use_context()
        launch(0, ptr.ptr, 4096)  # the default stream keeps using the block
        ptr.free()
        pending = pool.memory_stats()["active_bytes.all.current"]
        queried = side.query()
        pool.synchronize()
        settled = pool.memory_stats()["active_bytes.all.current"]
        side.synchronize()
        handles = [pool.default_stream.handle, side.handle]
        outside = pool.external_stream(side.handle)
        outside_ptr = pool.alloc(100, stream=outside)
        outside_stream = outside_ptr.__cuda_array_interface__["stream"]
        del outside_ptr
        outside.destroy()
        destroyed_after_outside = calls("cuStreamDestroy_v2")
        side.destroy()
        report(
            handles=handles, outside_stream=outside_stream, destroyed_after_outside=destroyed_after_outside,
            stream=cai["stream"], pending=pending, settled=settled, violations=violations(),
            created=calls("cuStreamCreate"), destroyed=calls("cuStreamDestroy_v2"),
            recorded=calls("cuEventRecord"), queries=calls("cuEventQuery"),
            synchronized=calls("cuEventSynchronize") + calls("cuStreamSynchronize"),
        )
        """,
        fake,
    )
    assert result["stream"] not in (None, 0, 1), "a created stream reports its own handle"
    assert result["pending"] > 0, "the free waits for the default stream's event"
    assert result["settled"] == 0
    assert result["violations"] == 0
    assert (result["created"], result["destroyed"]) == (1, 1)
    assert result["handles"][0] == 0 and result["handles"][1] == result["outside_stream"] == result["stream"]
    assert result["destroyed_after_outside"] == 0, "a wrapped stream is never destroyed by gpupool"
    assert result["recorded"] >= 1 and result["synchronized"] >= 1


def test_expandable_segments_map_pages_through_the_driver(fake):
    result = fake_driver.run(
        """
        pool = gpupool.Pool("cuda:0", config="expandable_segments:True")
        ptrs = [pool.alloc(3 << 20) for _ in range(6)]
        ptrs[4].copy_from_host(b"paged", offset=(1 << 20))
        data = ptrs[4].copy_to_host()[1 << 20:(1 << 20) + 5]
        mapped = calls("cuMemMap")
        del ptrs
        pool.empty_cache()
        pool.check_invariants()
        report(data=data.decode(), mapped=mapped, created=calls("cuMemCreate"), released=calls("cuMemRelease"),
               held=pool.device_memory_held())
        """,
        fake,
    )
    assert result["data"] == "paged"
    # PyTorch's expandable segments map the large pool in 20 MiB handles: 18 MiB of blocks is one.
    assert result["mapped"] == 1, "18 MiB of blocks fit one 20 MiB handle"
    assert result["created"] == result["released"] and result["held"] == 0


def test_default_maps_uneven_handles_through_the_driver(fake):
    # On 8 GiB a handle holds at most 16 MiB while the device has room: 30 MiB is 16 + 14.
    result = fake_driver.run(
        """
        pool = gpupool.Pool("cuda:0")
        ptr = pool.alloc(30 << 20)
        ptr.copy_from_host(b"tail", offset=(30 << 20) - 4)
        data = ptr.copy_to_host()[-4:]
        mapped = (calls("cuMemCreate"), calls("cuMemMap"), calls("cuMemSetAccess"))
        stats = pool.memory_stats()
        counted = (stats["num_driver_create"], stats["num_driver_map"], stats["num_driver_set_access"])
        del ptr
        pool.empty_cache()
        pool.check_invariants()
        report(data=data.decode(), mapped=mapped, counted=counted, unmapped=calls("cuMemUnmap"),
               released=calls("cuMemRelease"), held=pool.device_memory_held())
        """,
        fake,
        memory=8 << 30,
    )
    assert result["data"] == "tail"
    assert result["mapped"] == [2, 2, 1] and result["counted"] == result["mapped"]
    assert result["unmapped"] == 2 and result["released"] == 2 and result["held"] == 0


def test_the_initial_pool_is_mapped_when_the_pool_is_made(fake):
    # On 8 GiB a handle holds at most 16 MiB while the device has room: 40 MiB is 16 + 16 + 8.
    result = fake_driver.run(
        """
        pool = gpupool.Pool("cuda:0", config="initial_pool_size_mb:40")
        made = (calls("cuMemCreate"), calls("cuMemMap"), calls("cuMemSetAccess"), pool.device_memory_held())
        ptr = pool.alloc(30 << 20)
        ptr.copy_from_host(b"front", offset=(30 << 20) - 5)
        data = ptr.copy_to_host()[-5:]
        after = (calls("cuMemMap"), pool.memory_reserved())
        del ptr
        pool.empty_cache()
        pool.check_invariants()
        report(made=made, after=after, data=data.decode(), unmapped=calls("cuMemUnmap"),
               released=calls("cuMemRelease"), held=pool.device_memory_held(), violations=violations())
        """,
        fake,
        memory=8 << 30,
    )
    assert result["made"] == [3, 3, 1, 40 * MiB]
    assert result["after"] == [3, 40 * MiB], "a request within the initial pool maps nothing"
    assert result["data"] == "front"
    assert result["unmapped"] == 3 and result["released"] == 3 and result["held"] == 0
    assert result["violations"] == 0


def test_cuda_array_interface_and_dlpack_on_cuda(fake):
    result = fake_driver.run(
        """
        pool = gpupool.Pool("cuda:0")
        side = pool.stream()
        ptr = pool.alloc(64)
        cai = ptr.__cuda_array_interface__
        view = ptr.view("float32", (4, 4))
        vcai = view.__cuda_array_interface__
        side_handle = pool.alloc(8, stream=side).__cuda_array_interface__["stream"]
        capsule = ptr.__dlpack__(stream=side_handle)
        is_capsule = ctypes.pythonapi.PyCapsule_IsValid
        is_capsule.argtypes = [ctypes.py_object, ctypes.c_char_p]
        report(
            cai=cai, vcai_shape=vcai["shape"], vcai_type=vcai["typestr"], device=ptr.__dlpack_device__(),
            capsule=is_capsule(capsule, b"dltensor"), waits=calls("cuStreamWaitEvent"),
            host_view=hasattr(ptr, "__array_interface__"),
        )
        """,
        fake,
    )
    cai = result["cai"]
    assert cai["version"] == 3 and cai["typestr"] == "|u1" and cai["shape"] == [64]
    assert cai["data"][1] is False and cai["stream"] == 1, "the legacy default stream is 1"
    assert result["vcai_shape"] == [4, 4] and result["vcai_type"] == "<f4"
    assert result["device"] == [2, 0]
    assert result["capsule"] == 1
    assert result["waits"] == 1, "the consumer's stream waits for the allocation's"
    assert not result["host_view"]


def test_dlpack_ordering_leaves_captures_valid(fake):
    # Ordering the consumer after a capturing producer would record an event in the capture and
    # make the consumer wait for it, pulling the consumer into a capture that then cannot end
    # (it never rejoins); the legacy stream is unusable during a blocking stream's capture; and a
    # capturing consumer may not wait for an event recorded outside its capture: refused. A
    # consumer inside the same capture is ordered as usual.
    result = fake_driver.run(
        """
        use_context(0)
        pool = gpupool.Pool("cuda:0")
        side, other = pool.stream(), pool.stream()
        ptr = pool.alloc(64, stream=side)
        def export(consumer):
            try:
                ptr.__dlpack__(stream=consumer)
                return None
            except RuntimeError as e:
                return str(e)
        def end(stream):
            graph = ctypes.c_void_p()
            return driver().cuStreamEndCapture(stream.handle, ctypes.byref(graph))
        def wait(waiter, recorder):
            event = ctypes.c_void_p()
            assert driver().cuEventCreate(ctypes.byref(event), 2) == 0
            assert driver().cuEventRecord(event, ctypes.c_void_p(recorder.handle)) == 0
            assert driver().cuStreamWaitEvent(ctypes.c_void_p(waiter.handle), event, 0) == 0
        assert driver().cuStreamBeginCapture_v2(side.handle, 2) == 0
        refused = [export(None), export(other.handle)]
        ended = end(side)
        # A blocking stream's capture makes the legacy stream unusable, as a consumer too.
        blocking = ctypes.c_void_p()
        assert driver().cuStreamCreate(ctypes.byref(blocking), 0) == 0
        assert driver().cuStreamBeginCapture_v2(blocking, 2) == 0
        refused.append(export(None))
        graph = ctypes.c_void_p()
        blocking_ended = driver().cuStreamEndCapture(blocking, ctypes.byref(graph))
        # A capturing consumer of an allocation whose stream is outside the capture: it may not
        # wait for an event recorded there.
        assert driver().cuStreamBeginCapture_v2(other.handle, 2) == 0
        refused.append(export(other.handle))
        consumer_ended = end(other)
        # A forked capture: `other` joins it, is ordered after `side`, and rejoins.
        assert driver().cuStreamBeginCapture_v2(side.handle, 2) == 0
        wait(other, side)
        joined = export(other.handle)
        wait(side, other)
        report(refused=refused, ended=ended, blocking_ended=blocking_ended, joined=joined,
               joined_ended=end(side), consumer_ended=consumer_ended, side=side.id)
        """,
        fake,
    )
    assert all(e and "no order between streams can cross" in e for e in result["refused"]), result["refused"]
    # A capturing consumer's stream has only a temporary id: the message names the allocation's.
    assert f"cannot wait for stream {result['side']}, the allocation's" in result["refused"][3]
    assert result["ended"] == 0, "the consumer was pulled into the capture"
    assert result["blocking_ended"] == 0, "the legacy stream was used during a blocking stream's capture"
    assert result["consumer_ended"] == 0, "the capturing consumer waited for an event outside its capture"
    assert result["joined"] is None and result["joined_ended"] == 0


def test_dlpack_ordering_between_two_captures_is_refused(fake):
    # Two independent captures: ordering one's stream after the other's would merge them, which
    # the driver refuses by invalidating both. gpupool refuses first and leaves both running. A
    # consumer that joined the allocation's capture is in the same capture: it is ordered.
    result = fake_driver.run(
        """
        use_context(0)
        pool = gpupool.Pool("cuda:0")
        side, other = pool.stream(), pool.stream()
        ptr = pool.alloc(64, stream=side)
        lib = driver()
        def status(stream):
            status = ctypes.c_int(-1)
            assert lib.cuStreamIsCapturing(ctypes.c_void_p(stream.handle), ctypes.byref(status)) == 0
            return status.value
        def end(stream):
            graph = ctypes.c_void_p()
            return lib.cuStreamEndCapture(stream.handle, ctypes.byref(graph))
        def wait(waiter, recorder):
            event = ctypes.c_void_p()
            assert lib.cuEventCreate(ctypes.byref(event), 2) == 0
            assert lib.cuEventRecord(event, ctypes.c_void_p(recorder.handle)) == 0
            assert lib.cuStreamWaitEvent(ctypes.c_void_p(waiter.handle), event, 0) == 0
        assert lib.cuStreamBeginCapture_v2(side.handle, 2) == 0
        assert lib.cuStreamBeginCapture_v2(other.handle, 2) == 0
        try:
            ptr.__dlpack__(stream=other.handle)
            refused = None
        except RuntimeError as e:
            refused = str(e)
        apart = dict(refused=refused, statuses=[status(side), status(other)], ends=[end(side), end(other)])
        assert lib.cuStreamBeginCapture_v2(side.handle, 2) == 0
        wait(other, side)
        waits = calls("cuStreamWaitEvent")
        ptr.__dlpack__(stream=other.handle)
        ordered = calls("cuStreamWaitEvent") - waits
        wait(side, other)
        report(apart=apart, ordered=ordered, joined_end=end(side), violations=violations())
        """,
        fake,
    )
    apart = result["apart"]
    assert apart["refused"] and "two different CUDA graphs" in apart["refused"], apart["refused"]
    assert apart["statuses"] == [1, 1], "a capture was invalidated"
    assert apart["ends"] == [0, 0]
    assert result["ordered"] == 1, "the consumer in the allocation's capture was not ordered after it"
    assert result["joined_end"] == 0
    assert result["violations"] == 0


def test_the_fake_refuses_a_wait_that_merges_two_captures(fake):
    # The fake's own rule, which the test above relies on: each capture has an id, shared by the
    # streams that joined it; a capturing stream's wait for an event of another capture would
    # merge two independent captures, which is counted and invalidates both
    # (CUDA_ERROR_STREAM_CAPTURE_MERGE).
    result = fake_driver.run(
        """
        use_context(0)
        lib = driver()
        def stream():
            raw = ctypes.c_void_p()
            assert lib.cuStreamCreate(ctypes.byref(raw), 1) == 0
            return raw
        def info(s):
            status, capture = ctypes.c_int(-1), ctypes.c_ulonglong(0)
            assert lib.cuStreamGetCaptureInfo_v2(s, ctypes.byref(status), ctypes.byref(capture), None, None, None) == 0
            return [status.value, capture.value]
        a, b, joiner = stream(), stream(), stream()
        assert lib.cuStreamBeginCapture_v2(a, 2) == 0
        assert lib.cuStreamBeginCapture_v2(b, 2) == 0
        event = ctypes.c_void_p()
        assert lib.cuEventCreate(ctypes.byref(event), 2) == 0
        assert lib.cuEventRecord(event, a) == 0
        assert lib.cuStreamWaitEvent(joiner, event, 0) == 0
        before = info(a), info(b), info(joiner)
        no_status = lib.cuStreamGetCaptureInfo_v2(a, None, None, None, None, None)
        clean = violations()
        merge = lib.cuStreamWaitEvent(b, event, 0)
        statuses = [info(s)[0] for s in (a, b, joiner)]
        graph = ctypes.c_void_p()
        ends = [lib.cuStreamEndCapture(s, ctypes.byref(graph)) for s in (a, b)]
        report(before=before, no_status=no_status, clean=clean, merge=merge, statuses=statuses, ends=ends,
               violations=violations(), idle=info(a)[0])
        """,
        fake,
    )
    (a_status, a_id), (b_status, b_id), (joiner_status, joiner_id) = result["before"]
    assert a_status == b_status == joiner_status == 1
    assert a_id == joiner_id != b_id, "a joined stream shares its capture's id; another capture has its own"
    assert result["no_status"] == 1, "the status is required (CUDA_ERROR_INVALID_VALUE)"
    assert result["clean"] == 0
    assert result["merge"] == 902, "CUDA_ERROR_STREAM_CAPTURE_MERGE"
    assert result["statuses"] == [2, 2, 2], "both captures, joined streams included, are invalidated"
    assert result["ends"] == [901, 901]
    assert result["violations"] == 1 and result["idle"] == 0


def test_the_fake_counts_a_capture_waiting_for_outside_work(fake):
    # The fake's own rules: a capturing stream's plain wait for an event recorded outside its
    # capture breaks the capture's isolation (it would need CU_EVENT_WAIT_EXTERNAL); an event
    # recorded in a capture cannot be queried or waited for on the host, nor waited for by any
    # stream once its capture has ended. The driver refuses these, the first two breaking the
    # user's capture, so a pool that does any is counted.
    result = fake_driver.run(
        """
        use_context(0)
        lib = driver()
        raws = [ctypes.c_void_p() for _ in range(2)]
        for raw in raws:
            assert lib.cuStreamCreate(ctypes.byref(raw), 1) == 0
        capturing, outside = raws
        event = ctypes.c_void_p()
        assert lib.cuEventCreate(ctypes.byref(event), 2) == 0
        assert lib.cuEventRecord(event, outside) == 0
        assert lib.cuStreamBeginCapture_v2(capturing, 2) == 0
        clean = violations()
        wait = lib.cuStreamWaitEvent(capturing, event, 0)
        graph = ctypes.c_void_p()
        end = lib.cuStreamEndCapture(capturing, ctypes.byref(graph))
        isolation = violations() - clean
        assert lib.cuStreamBeginCapture_v2(capturing, 2) == 0
        assert lib.cuEventRecord(event, capturing) == 0
        host = [lib.cuEventQuery(event), lib.cuEventSynchronize(event)]
        end_after_host = lib.cuStreamEndCapture(capturing, ctypes.byref(graph))
        after_end = lib.cuStreamWaitEvent(outside, event, 0)
        report(clean=clean, wait=wait, end=end, isolation=isolation, host=host, end_after_host=end_after_host,
               after_end=after_end, captured=violations() - clean - isolation)
        """,
        fake,
    )
    assert result == {
        "clean": 0,
        "wait": 905,
        "end": 901,
        "isolation": 1,
        "host": [907, 907],
        "end_after_host": 901,
        "after_end": 907,
        "captured": 3,
    }


def test_the_fake_counts_any_use_of_a_destroyed_event(fake):
    # The fake's own rule, which every other test relies on to see a dangling event handle: a
    # destroyed event's address goes to no new event, and using it is a violation.
    result = fake_driver.run(
        """
        use_context(0)
        lib = driver()
        lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        for name in ("cuEventQuery", "cuEventSynchronize", "cuEventDestroy_v2"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
        lib.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        def event():
            e = ctypes.c_void_p()
            assert lib.cuEventCreate(ctypes.byref(e), 2) == 0
            return e.value
        dead = event()
        assert lib.cuEventRecord(dead, None) == 0 and lib.cuEventDestroy_v2(dead) == 0
        clean = violations()
        uses = [lib.cuEventRecord(dead, None), lib.cuEventQuery(dead), lib.cuEventSynchronize(dead),
                lib.cuStreamWaitEvent(None, dead, 0), lib.cuEventDestroy_v2(dead)]
        after = violations()
        fresh = [event() for _ in range(64)]
        report(clean=clean, uses=uses, counted=after - clean, reused=dead in fresh, live=lib.cuEventQuery(fresh[0]))
        """,
        fake,
    )
    assert result["clean"] == 0
    assert result["uses"] == [400] * 5, "CUDA_ERROR_INVALID_HANDLE"
    assert result["counted"] == 5, "each use of the destroyed event is a violation"
    assert not result["reused"], "a new event took the destroyed one's address"
    assert result["live"] == 0


def test_c_abi_on_the_cuda_backend(fake):
    result = fake_driver.run(
        """
        lib = ctypes.CDLL(_native.__file__)
        lib.gpupool_alloc.restype = ctypes.c_void_p
        lib.gpupool_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.gpupool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        _native._capi_configure("cuda", "strategy:pytorch")
        ptrs = [lib.gpupool_alloc(1 << 16, 0, None) for _ in range(10)]
        for p in ptrs:
            lib.gpupool_free(p, 1 << 16, 0, None)
        again = lib.gpupool_alloc(1 << 16, 0, None)
        missing = lib.gpupool_alloc(1 << 16, 5, None)
        error = _native._capi_last_error()
        report(distinct=len(set(ptrs)), reused=again in ptrs, missing=missing, error=error,
               allocs=calls("cuMemAlloc_v2"), stats=_native._capi_memory_stats(0)["allocation.all.current"])
        """,
        fake,
    )
    assert result["distinct"] == 10 and result["reused"]
    assert result["allocs"] == 1
    assert result["missing"] is None and "cuda:5 does not exist" in result["error"]
    assert result["stats"] == 1


def test_every_entry_point_leaves_the_callers_context(fake):
    result = fake_driver.run(
        """
        lib = ctypes.CDLL(_native.__file__)
        lib.gpupool_alloc.restype = ctypes.c_void_p
        lib.gpupool_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.gpupool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        seen = {}
        def after(step):
            seen[step] = current_context()
        mine = use_context(1)  # this thread works on device 1, as PyTorch's current device
        pool = gpupool.Pool("cuda:0", config="strategy:expandable")
        after("open")
        ptr = pool.alloc(3 << 20); after("alloc")
        ptr.copy_from_host(b"x" * 10); after("copy in")
        ptr.copy_to_host(); after("copy out")
        side = pool.stream(); after("stream")
        pool.record_stream(ptr, side); after("record_stream")
        side.query(); side.synchronize(); after("stream calls")
        ptr.free(); pool.synchronize(); after("free")
        pool.empty_cache(); after("empty_cache")
        try:
            pool.alloc(1 << 40)
        except gpupool.OutOfMemoryError:
            after("out of memory")
        raw = lib.gpupool_alloc(1 << 20, 0, None); after("C alloc")
        lib.gpupool_free(raw, 1 << 20, 0, None); after("C free")
        _native._capi_empty_cache(); after("C empty_cache")
        del pool, side; after("close")
        report(mine=mine, seen=seen)
        """,
        fake,
        device_count=2,
    )
    changed = {step: context for step, context in result["seen"].items() if context != result["mine"]}
    assert changed == {}, "these calls left another context current"
    assert len(result["seen"]) == 14


def test_copies_wait_for_the_work_on_the_blocks_stream(fake):
    result = fake_driver.run(
        """
        pool = gpupool.Pool("cuda:0")
        side = pool.stream()
        ptr = pool.alloc(4096, stream=side)
        use_context()
        launch(side.handle, ptr.ptr, 4096, 0x55)  # still running when the copy is asked for
        ptr.copy_from_host(b"after the kernel")
        data = ptr.copy_to_host()[:16]
        report(data=data.decode(), violations=violations())
        """,
        fake,
    )
    assert result["data"] == "after the kernel", "the copy ran before the kernel queued ahead of it"
    assert result["violations"] == 0


def test_pages_below_the_drivers_granularity_are_rounded_up(fake):
    result = fake_driver.run(
        """
        pool = gpupool.Pool("cuda:0", config="page_size_mb:2")
        ptrs = [pool.alloc(5 << 20) for _ in range(3)]
        ptrs[2].copy_from_host(b"x" * (5 << 20))
        report(page=pool.config["page_size_mb"], held=pool.device_memory_held())
        """,
        fake,
        granularity=4 * MiB,
    )
    assert result["page"] == 4, "the effective page is the driver's granularity"
    assert result["held"] % (4 * MiB) == 0


def test_a_failed_unmap_leaves_no_block_on_unbacked_pages(fake):
    result = fake_driver.run(
        """
        pool = gpupool.Pool("cuda:0", config="strategy:expandable")
        ptrs = [pool.alloc(7 << 20) for _ in range(6)]
        del ptrs
        try:
            pool.empty_cache()
            error = None
        except RuntimeError as e:
            error = str(e)
        pool.check_invariants()  # the device holds exactly what the page map says is mapped
        held_after_failure = pool.device_memory_held()
        again = [pool.alloc(7 << 20) for _ in range(6)]
        for p in again:
            p.copy_from_host(b"y" * (7 << 20))  # the fake refuses copies to unbacked pages
        pool.check_invariants()
        report(error=error, held=held_after_failure, violations=violations())
        """,
        fake,
        fail_unmap=3,
    )
    assert "cuMemUnmap" in result["error"]
    assert result["held"] > 0, "pages after the failure stay mapped and known"
    assert result["violations"] == 0


def test_a_failed_unmap_at_close_keeps_its_range_reserved(fake):
    # Teardown ignores errors, but a range with a mapping left in it must not be freed.
    result = fake_driver.run(
        """
        import gc
        pool = gpupool.Pool("cuda:0", config="strategy:expandable")
        pool.alloc(7 << 20).free()
        unmapped = calls("cuMemUnmap")
        del pool
        gc.collect()
        report(unmapped=unmapped, violations=violations(), mappings=mappings())
        """,
        fake,
        fail_unmap=1,
    )
    assert result["unmapped"] == 0, "the cached pages stay mapped until the pool closes"
    assert result["mappings"] > 0, "the failed unmap left a mapping"
    assert result["violations"] == 0


def test_shareable_handles_and_peer_access(fake):
    result = fake_driver.run(
        """
        lib = driver()
        def exportable(ptr):
            handle = ctypes.c_ulonglong()
            assert lib.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(ptr.ptr)) == 0
            fd = ctypes.c_int(-1)
            status = lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle, 1, ctypes.c_ulonglong(0))
            lib.cuMemRelease(handle)
            return status == 0 and fd.value >= 0
        plain = gpupool.Pool("cuda:0")
        shared = gpupool.Pool("cuda:0", config="shareable_handle:posix_fd,peer_access:[1]")
        a, b = plain.alloc(1 << 20), shared.alloc(1 << 20)
        b.copy_from_host(b"peer")
        report(plain=exportable(a), shared=exportable(b), config=[shared.config["shareable_handle"],
               shared.config["peer_access"]], peer_checks=calls("cuDeviceCanAccessPeer"))
        """,
        fake,
        device_count=2,
    )
    assert not result["plain"] and result["shared"], "only posix_fd pages can be exported"
    assert result["config"] == ["posix_fd", [1]]
    assert result["peer_checks"] == 1


def test_an_unreachable_peer_is_named(fake):
    result = fake_driver.run(
        """
        pool = gpupool.Pool("cuda:0", config="peer_access:[3]")
        try:
            pool.alloc(1 << 20)
            error = None
        except RuntimeError as e:
            error = str(e)
        report(error=error)
        """,
        fake,
        device_count=2,
    )
    assert "peer_access: cuda:3 cannot access cuda:0" in result["error"]


def test_only_live_allocations_are_exported_to_other_processes(fake):
    # A freed pointer's bytes belong to the cache (and soon to another allocation): neither
    # its pages nor its segment's IPC handle may leave the process, nor a range that runs past
    # the allocation.
    result = fake_driver.run(
        """
        def refusal(call):
            try:
                call()
                return None
            except ValueError as e:
                return str(e)
        pages = gpupool.Pool("cuda:0", config="strategy:pages,shareable_handle:posix_fd")
        keep, freed = pages.alloc(2 << 20), pages.alloc(2 << 20)
        address = freed.ptr
        freed.free()
        plain = gpupool.Pool("cuda:0", config="strategy:pytorch")
        live, gone = plain.alloc(1 << 20), plain.alloc(1 << 20)
        gone_address = gone.ptr
        gone.free()
        report(freed_pages=refusal(lambda: _native._export_pages(pages, address, 2 << 20)),
               past_end=refusal(lambda: _native._export_pages(pages, keep.ptr, 4 << 20)),
               freed_handle=refusal(lambda: _native._ipc_handle(plain, gone_address)),
               live_handle=refusal(lambda: _native._ipc_handle(plain, live.ptr + 100)))
        """,
        fake,
    )
    assert "not inside a live allocation" in result["freed_pages"]
    assert "not inside a live allocation" in result["past_end"]
    assert "not inside a live allocation" in result["freed_handle"]
    assert result["live_handle"] is None


def test_exported_pages_map_in_another_range_until_closed(fake):
    # The fake keeps each range's bytes apart, so only the mappings are checked, not the data.
    result = fake_driver.run(
        """
        import os
        pool = gpupool.Pool("cuda:0", config="strategy:pages,shareable_handle:posix_fd")
        ptr = pool.alloc(3 << 20)
        pid, pages, offset = _native._export_pages(pool, ptr.ptr, 3 << 20)
        mapped = mappings()
        imported = _native._import_pages(0, pid, pages)
        added = mappings() - mapped
        imported.close()
        for fd, *_ in pages:
            os.close(fd)
        report(pid=pid == os.getpid(), sizes=[size for _, size, *_ in pages], offset=offset, added=added,
               apart=imported.base != ptr.ptr - offset, left=mappings() - mapped,
               violations=violations())
        """,
        fake,
    )
    assert result["pid"] and result["sizes"] == [2 << 20, 2 << 20], "one descriptor per 2 MiB page"
    assert result["offset"] == 0 and result["apart"]
    assert (result["added"], result["left"], result["violations"]) == (2, 0, 0)


def test_a_failed_release_leaks_no_descriptor_and_no_mapping(fake):
    # cuMemRelease failing after an export or an import map: the descriptor is closed, the
    # mapping undone (else the range could not be freed).
    result = fake_driver.run(
        """
        import os
        pool = gpupool.Pool("cuda:0", config="strategy:pages,shareable_handle:posix_fd")
        ptr = pool.alloc(2 << 20)
        def failing_next_release(call):
            os.environ["FAKE_CUDA_FAIL_RELEASE"] = str(calls("cuMemRelease") + 1)
            try:
                call()
                return None
            except RuntimeError as e:
                return str(e)
        descriptors = len(os.listdir("/proc/self/fd"))
        export_error = failing_next_release(lambda: _native._export_pages(pool, ptr.ptr, 2 << 20))
        leaked = len(os.listdir("/proc/self/fd")) - descriptors
        pid, pages, offset = _native._export_pages(pool, ptr.ptr, 2 << 20)
        mapped = mappings()
        import_error = failing_next_release(lambda: _native._import_pages(0, pid, pages))
        report(export_error=export_error, leaked=leaked, import_error=import_error,
               left=mappings() - mapped)
        """,
        fake,
    )
    assert "cuMemRelease" in result["export_error"] and result["leaked"] == 0
    assert "cuMemRelease" in result["import_error"] and result["left"] == 0


def test_closing_imported_pages_reports_a_failed_unmap_and_retries(fake):
    result = fake_driver.run(
        """
        pool = gpupool.Pool("cuda:0", config="strategy:pages,shareable_handle:posix_fd")
        ptr = pool.alloc(2 << 20)
        pid, pages, offset = _native._export_pages(pool, ptr.ptr, 2 << 20)
        mapped = mappings()
        imported = _native._import_pages(0, pid, pages)
        def close():
            frees = calls("cuMemAddressFree")
            try:
                imported.close()
                error = None
            except RuntimeError as e:
                error = str(e)
            return error, mappings() - mapped, calls("cuMemAddressFree") - frees
        report(failed=close(), retried=close(), again=close())
        """,
        fake,
        fail_unmap=1,
    )
    error, kept, freed = result["failed"]
    assert "cuMemUnmap" in error and (kept, freed) == (1, 0), "the mapping stays, and so does its range"
    assert result["retried"] == [None, 0, 1], "a later close() finishes the job"
    assert result["again"] == [None, 0, 0]


PEER_ACCESS = """
def attempt(config):
    try:
        gpupool.Pool("cuda:0", config=config).alloc(1 << 20)
        return None
    except RuntimeError as e:
        return str(e)
report(error=attempt("peer_access:[1]"), with_self=attempt("peer_access:[0,1]"),
       checks=calls("cuDeviceCanAccessPeer"))
"""


def test_peer_access_asks_whether_the_peer_reaches_this_device(fake):
    # Device handles are not ordinals in the fake, and access may be one-way.
    peer_cannot_reach = fake_driver.run(PEER_ACCESS, fake, device_count=2, no_peer="1:0")
    this_cannot_reach = fake_driver.run(PEER_ACCESS, fake, device_count=2, no_peer="0:1")
    assert "peer_access: cuda:1 cannot access cuda:0" in peer_cannot_reach["error"]
    assert this_cannot_reach["error"] is None and this_cannot_reach["with_self"] is None
    # The device itself always reaches its memory: it is not asked about.
    assert this_cannot_reach["checks"] == 2


def test_a_device_without_the_drivers_features_is_named(fake):
    snippet = """
    def attempt(make):
        try:
            make()
            return None
        except (RuntimeError, NotImplementedError) as e:
            return str(e)
    report(paged=attempt(lambda: gpupool.Pool("cuda:0").alloc(1 << 20)),
           plain=attempt(lambda: gpupool.Pool("cuda:0", config="strategy:pytorch").alloc(1 << 20)),
           shared=attempt(lambda: gpupool.Pool("cuda:0", config="shareable_handle:posix_fd").alloc(1 << 20)),
           stream_ordered=attempt(lambda: gpupool.Device("cuda:0", mode="async")),
           creates=calls("cuMemCreate"))
    """
    no_vmm = fake_driver.run(snippet, fake, no_vmm=1)
    assert "virtual memory management" in no_vmm["paged"] and no_vmm["plain"] is None
    assert no_vmm["creates"] == 0, "no cuMemCreate on a device without virtual memory management"
    no_fd = fake_driver.run(snippet, fake, no_posix_fd=1)
    assert no_fd["paged"] is None and "POSIX file descriptors" in no_fd["shared"]
    no_pools = fake_driver.run(snippet, fake, no_mempools=1)
    assert no_pools["paged"] is None and "stream-ordered memory pools" in no_pools["stream_ordered"]


@pytest.mark.parametrize("config", ["", "strategy:expandable", "strategy:pytorch", "backend:cudaMallocAsync"])
def test_the_pool_counts_the_driver_calls_the_backend_makes(fake, config):
    result = fake_driver.run(
        f"""
        KINDS = {{"malloc": ("cuMemAlloc_v2", "cuMemAllocAsync"), "free": ("cuMemFree_v2", "cuMemFreeAsync"),
                  "reserve": ("cuMemAddressReserve",), "unreserve": ("cuMemAddressFree",),
                  "create": ("cuMemCreate",), "map": ("cuMemMap",), "set_access": ("cuMemSetAccess",),
                  "unmap": ("cuMemUnmap",), "release": ("cuMemRelease",)}}
        def workload(pool):
            live = []
            for i in range(60):
                live.append(pool.alloc((i % 7 + 1) * 700_000 + i * 4096))
                if i % 3 == 2:
                    live.pop(i % len(live)).free()
            del live
            pool.empty_cache()
            pool.alloc(30 << 20).free()
            return {{kind: pool.memory_stats()["num_driver_" + kind] for kind in KINDS}}
        pool = gpupool.Pool("cuda:0", config={config!r})  # kept open: closing it makes calls of its own
        counted = workload(pool)
        made = {{kind: sum(calls(name) for name in names) for kind, names in KINDS.items()}}
        simulated = workload(gpupool.Pool("sim", capacity="1GiB", config={config!r}))
        report(counted=counted, made=made, simulated=simulated)
        """,
        fake,
    )
    assert result["counted"] == result["made"], "the pool's count is what the driver was asked"
    assert result["simulated"] == result["counted"], "a replay on sim counts the same calls"
    assert sum(result["counted"].values()) > 0
