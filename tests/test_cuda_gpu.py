"""gpupool on a real GPU: the pool and stream contracts on ``cuda:0``, copies, and interop with
PyTorch, CuPy and Numba. Every test is marked ``gpu`` and skipped without a usable CUDA driver.

benches/gpu_check.sh runs this file on the GPU machine; CI only sees the skips.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import settings

import gpupool
from pool_checks import EXAMPLES_SCALE, MiB

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpupool.cuda_available(), reason="no usable CUDA driver and GPU"),
]

GPU_SETTINGS = settings(max_examples=25 * EXAMPLES_SCALE, stateful_step_count=40, deadline=None)


def needs(module: str):
    if not gpupool.cuda_available():
        return pytest.mark.skip(reason="no usable CUDA driver and GPU")
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"{module} is not installed")


def run_python(code: str) -> str:
    """Runs ``code`` in a fresh interpreter (frameworks that must be set up before first use)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return done.stdout


# ---- the pool contract on cuda:0 (the stream machine's model of busy streams is the simulated
# one, so real streams get the deterministic test below instead) ----

if gpupool.cuda_available():
    from test_pool_state_machine import PoolMachine

    class CudaPoolMachine(PoolMachine):
        device = "cuda:0"
        capacity = 512 * MiB

    TestCudaPool = CudaPoolMachine.TestCase
    TestCudaPool.settings = GPU_SETTINGS


@needs("torch")
def test_a_freed_block_waits_for_real_work_on_its_streams():
    import torch

    pool = gpupool.Pool("cuda:0")
    side = pool.stream()
    ptr = pool.alloc(MiB)
    address = ptr.ptr
    ptr.record_stream(side)
    with torch.cuda.stream(torch.cuda.ExternalStream(side.handle)):
        # About 0.1 s of spinning: far longer than the allocations below take.
        torch.cuda._sleep(200_000_000)
    ptr.free()
    assert not side.query()
    stats = pool.memory_stats()
    assert stats["active_bytes.all.current"] > stats["allocated_bytes.all.current"], "the free is pending"
    other = pool.alloc(MiB)
    assert other.ptr != address, "the block was reused while the side stream could still use it"
    side.synchronize()
    pool.synchronize()
    assert pool.alloc(MiB).ptr == address


# ---- the backend ----


def test_default_device_is_the_gpu():
    assert gpupool.device_count() >= 1
    assert gpupool.Pool().device == "cuda:0"


def test_copies_round_trip():
    data = os.urandom(64 * MiB + 3)
    with gpupool.Pool("cuda:0").alloc(len(data)) as ptr:
        ptr.copy_from_host(data)
        assert ptr.copy_to_host() == data


def test_out_of_memory_is_an_exception():
    pool = gpupool.Pool("cuda:0")
    with pytest.raises(gpupool.OutOfMemoryError, match="cuda:0"):
        pool.alloc(1 << 50)
    assert pool.alloc(MiB).size == MiB


@pytest.mark.parametrize("mode", ["direct", "async"])
def test_direct_and_async_devices(mode):
    device = gpupool.Device("cuda:0", mode=mode)
    addresses = [device.allocate(MiB) for _ in range(8)]
    assert len(set(addresses)) == 8
    for address in addresses:
        device.release(address)


def test_expandable_segments_map_pages_on_the_gpu():
    try:
        pool = gpupool.Pool("cuda:0", config="expandable_segments:True")
    except ValueError:
        pytest.skip("this build has no expandable segments")
    ptrs = [pool.alloc(3 * MiB) for _ in range(10)]
    ptrs[5].copy_from_host(b"mapped" * 1000)
    assert ptrs[5].copy_to_host()[:6] == b"mapped"
    del ptrs
    pool.empty_cache()
    pool.check_invariants()


# ---- interop ----


@needs("cupy")
def test_cupy_wraps_without_copying():
    import cupy

    pool = gpupool.Pool("cuda:0")
    ptr = pool.alloc(4096)
    array = cupy.asarray(ptr)
    assert array.data.ptr == ptr.ptr and array.nbytes == 4096
    floats = cupy.asarray(ptr.view("float32", (32, 32)))
    floats[:] = 2.0
    assert float(cupy.from_dlpack(ptr.view("float32", (32, 32))).sum()) == 2048.0


@needs("cupy")
def test_cupy_allocator():
    import cupy

    import gpupool.cupy

    pool = gpupool.Pool("cuda:0")
    cupy.cuda.set_allocator(gpupool.cupy.allocator(pool))
    try:
        a = cupy.arange(1 << 20, dtype=cupy.float32)
        assert pool.memory_allocated() >= 4 * MiB
        assert float(a[-1]) == (1 << 20) - 1
        del a
        assert pool.memory_allocated() == 0
    finally:
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)


@needs("torch")
def test_torch_wraps_without_copying():
    import torch

    pool = gpupool.Pool("cuda:0")
    ptr = pool.alloc(1024)
    ptr.copy_from_host(bytes(range(256)) * 4)
    tensor = torch.as_tensor(ptr, device="cuda")
    assert tensor.data_ptr() == ptr.ptr and tensor[255].item() == 255
    floats = torch.from_dlpack(ptr.view("float32", (16, 16)))
    assert floats.data_ptr() == ptr.ptr and floats.shape == (16, 16)
    floats.fill_(1.0)
    torch.cuda.synchronize()
    assert ptr.copy_to_host()[:4] == b"\x00\x00\x80\x3f"


@needs("torch")
def test_torch_streams_are_wrapped_by_handle():
    import torch

    pool = gpupool.Pool("cuda:0")
    side = torch.cuda.Stream()
    stream = pool.external_stream(side.cuda_stream)
    assert stream.handle == side.cuda_stream
    ptr = pool.alloc(MiB, stream=stream)
    assert ptr.__cuda_array_interface__["stream"] == side.cuda_stream
    with torch.cuda.stream(side):
        torch.as_tensor(ptr, device="cuda").fill_(7)
    stream.synchronize()
    assert ptr.copy_to_host()[:1] == b"\x07"


@needs("numba")
def test_numba_wraps_without_copying():
    import numpy as np
    from numba import cuda

    ptr = gpupool.Pool("cuda:0").alloc(400)
    array = cuda.as_cuda_array(ptr.view("int32", (100,)))
    assert array.__cuda_array_interface__["data"][0] == ptr.ptr
    array.copy_to_device(np.arange(100, dtype=np.int32))
    assert np.frombuffer(ptr.copy_to_host(), dtype=np.int32)[99] == 99


@needs("numba")
def test_numba_memory_manager():
    out = run_python(
        """
        from numba import cuda
        import numpy as np
        import gpupool.numba
        cuda.set_memory_manager(gpupool.numba.GpupoolMemoryManager)
        a = cuda.to_device(np.arange(1 << 20, dtype=np.float32))
        manager = cuda.current_context().memory_manager
        assert manager.pool.memory_allocated() >= 4 << 20
        assert a.copy_to_host()[-1] == (1 << 20) - 1
        print("numba ok")
        """
    )
    assert "numba ok" in out


@needs("torch")
def test_torch_trains_with_gpupool_as_its_allocator():
    out = run_python(
        """
        import torch
        import gpupool.torch
        gpupool.torch.install()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(1024, 256, device="cuda")
        y = x[:, :10].argmax(dim=1)  # a learnable rule, so the loss must fall
        losses = []
        for step in range(100):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if step == 4:
                warm = gpupool.torch.memory_stats(0)["num_driver_calls"]
        stats = gpupool.torch.memory_stats(0)
        # Every step's tensors came from gpupool, and once warm the steps were served from its
        # cache: a caching allocator asks the driver for nothing in a steady loop.
        assert stats["allocation.all.allocated"] >= 100 * 4, stats
        assert stats["num_driver_calls"] == warm, stats
        assert losses[-1] < losses[0] * 0.7, losses
        del model, optimizer, x, y, loss
        print("torch ok", losses[0], losses[-1], stats["num_driver_calls"])
        """
    )
    assert "torch ok" in out
