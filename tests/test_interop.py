"""Zero-copy hand-off on host memory (DLPack, views), the C ABI through ctypes, and lazy imports."""

from __future__ import annotations

import ctypes
import gc
import importlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import gpupool
from gpupool import _native


@pytest.fixture
def pool():
    return gpupool.Pool("host")


def test_numpy_from_dlpack_shares_memory(pool):
    ptr = pool.alloc(64)
    ptr.copy_from_host(bytes(range(64)))
    array = np.from_dlpack(ptr)
    assert array.dtype == np.uint8 and array.shape == (64,)
    array[:4] = 99
    assert ptr.copy_to_host()[:4] == bytes([99] * 4)
    assert ptr.__dlpack_device__() == (1, 0)


def _capsule_name(capsule) -> str:
    name = ctypes.pythonapi.PyCapsule_GetName
    name.restype = ctypes.c_char_p
    name.argtypes = [ctypes.py_object]
    return name(capsule).decode()


def test_consumers_get_the_newest_abi_they_read(pool):
    ptr = pool.alloc(16)
    assert _capsule_name(ptr.__dlpack__()) == "dltensor"
    assert _capsule_name(ptr.__dlpack__(max_version=(0, 8))) == "dltensor"
    assert _capsule_name(ptr.__dlpack__(max_version=(1, 0))) == "dltensor_versioned"
    assert _capsule_name(ptr.view("uint16").__dlpack__(max_version=(1, 3))) == "dltensor_versioned"


def test_an_export_keeps_the_memory_alive(pool):
    ptr = pool.alloc(4096)
    array = np.from_dlpack(ptr.view("int32"))
    array[:] = np.arange(1024)
    del ptr
    gc.collect()
    assert pool.memory_allocated() > 0, "the array still holds the allocation"
    assert array.sum() == sum(range(1024))
    del array
    gc.collect()
    assert pool.memory_allocated() == 0


def test_an_unconsumed_capsule_frees_its_reference(pool):
    ptr = pool.alloc(128)
    capsule = ptr.__dlpack__()
    del ptr
    gc.collect()
    assert pool.memory_allocated() > 0
    del capsule
    gc.collect()
    assert pool.memory_allocated() == 0


def test_views_have_dtype_and_shape(pool):
    ptr = pool.alloc(96)
    view = ptr.view(np.float32, (4, 6))
    assert isinstance(view, gpupool.View)
    assert view.shape == (4, 6) and view.typestr == "<f4" and view.nbytes == 96
    np.asarray(view)[:] = 1.5
    assert np.from_dlpack(view).sum() == 1.5 * 24
    assert np.asarray(ptr.view("int16")).shape == (48,)
    assert np.asarray(ptr.view("complex64", 12)).dtype == np.complex64
    assert np.from_dlpack(ptr.view("bool", (2, 3))).dtype == np.bool_
    # Extents are integers as NumPy takes them, NumPy's own among them.
    assert ptr.view("float32", np.int64(24)).shape == (24,)
    assert ptr.view("float32", (np.int32(4), np.uint8(6))).shape == (4, 6)


@pytest.mark.skipif(np.lib.NumpyVersion(np.__version__) < "2.0.0", reason="NumPy 1 passes no copy argument")
def test_asarray_copies_only_when_asked_or_converting(pool):
    ptr = pool.alloc(16)
    same = np.asarray(ptr, dtype=np.uint8, copy=False)
    same[:] = 5
    assert ptr.copy_to_host() == b"\x05" * 16, "an array of the bytes' own dtype is no copy"
    with pytest.raises(ValueError, match="copy=False"):
        np.asarray(ptr, dtype=np.float32, copy=False)
    for copied in (np.asarray(ptr, copy=True), np.asarray(ptr, dtype=np.float32)):
        copied[:] = 7
    assert ptr.copy_to_host() == b"\x05" * 16, "a copy wrote through"
    assert ptr.exports == 1, "a copy still pins the bytes"


@pytest.mark.parametrize(
    ("dtype", "shape", "error"),
    [
        ("float64", (13,), ValueError),
        ("float32", (-1, 2), ValueError),
        (">f4", None, TypeError),
        ("U4", None, TypeError),
        # Read extent by extent, a string was a shape ("12" gave (1, 2)) and a float was cut short.
        ("uint8", "12", TypeError),
        ("uint8", (2.7,), TypeError),
        ("uint8", 2.5, TypeError),
        ("uint8", (True, 3), TypeError),
    ],
)
def test_bad_views_are_refused(pool, dtype, shape, error):
    with pytest.raises(error):
        pool.alloc(96).view(dtype, shape)


def test_a_view_cannot_be_reshaped_past_its_allocation(pool):
    # Its interfaces pair the export's address with shape and typestr: changing them later would
    # hand numpy bytes past the allocation.
    view = pool.alloc(4096).view("uint8")
    for name, value in (("shape", (1 << 34,)), ("typestr", "<f8"), ("_export", None), ("ptr", None)):
        with pytest.raises(AttributeError, match="read-only"):
            setattr(view, name, value)
    with pytest.raises(AttributeError):
        del view.shape
    assert view.__array_interface__["shape"] == (4096,) and view.nbytes == 4096


def test_a_dlpack_shape_whose_bit_count_wraps_is_refused(pool):
    # 2**61 - 1 four-bit elements: the bit count is one short of wrapping when rounded up to bytes.
    with pytest.raises(ValueError, match="does not fit"):
        pool.alloc(16)._export()._dlpack(0, 4, [2**61 - 1], None, None)


def test_export_refusals(pool):
    ptr = pool.alloc(16)
    with pytest.raises(BufferError):
        ptr.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        ptr.__dlpack__(dl_device=(2, 0))
    assert not hasattr(ptr, "__cuda_array_interface__")
    ptr.free()
    with pytest.raises(ValueError, match="freed"):
        ptr.__dlpack__()
    sim = gpupool.Pool("sim", capacity="1GiB").alloc(16)
    with pytest.raises(BufferError):
        sim.__dlpack__()
    assert not hasattr(sim, "__cuda_array_interface__")


def test_numpy_refuses_memory_the_host_cannot_read(pool):
    ptr = gpupool.Pool("sim", capacity="1GiB").alloc(16)
    for source in (ptr, ptr.view("f4")):
        with pytest.raises(TypeError, match="device 'sim' is not host-accessible"):
            np.asarray(source)
    del source
    assert ptr.exports == 0, "a refused conversion left its pin"
    view = pool.alloc(16).view("f4")
    view.__array__()[:] = 1.5  # called directly on host memory, it is the zero-copy array
    assert np.asarray(view).sum() == 6


def test_the_per_thread_default_stream_is_refused(pool):
    # Handle 2 names a different stream on each thread: no pool could order its blocks' reuse.
    with pytest.raises(ValueError, match="per-thread default stream"):
        pool.external_stream(2)


def test_simulated_streams_have_no_handles(pool):
    assert pool.default_stream.handle is None and pool.stream().handle is None
    with pytest.raises(RuntimeError, match="external streams"):
        pool.external_stream(0x1234)


def test_cuda_queries_never_raise():
    assert isinstance(gpupool.cuda_available(), bool)
    assert isinstance(gpupool.device_count(), int)
    if not gpupool.cuda_available():
        assert gpupool.Pool().device == "host"


def _capi():
    lib = ctypes.CDLL(_native.__file__)
    lib.gpupool_alloc.restype = ctypes.c_void_p
    lib.gpupool_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.gpupool_free.restype = None
    lib.gpupool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    return lib


def test_c_abi_on_the_host_backend():
    lib = _capi()
    _native._capi_configure("host", "")
    sizes = [1, 4096, 3 << 20, 700]
    ptrs = [lib.gpupool_alloc(size, 0, None) for size in sizes]
    assert all(ptrs) and len(set(ptrs)) == len(ptrs)
    ctypes.memset(ptrs[1], 0x5A, 4096)
    assert ctypes.string_at(ptrs[1], 4) == b"ZZZZ"
    # An empty tensor's request: null, counted nowhere, as with PyTorch's own allocator.
    assert lib.gpupool_alloc(0, 0, None) is None
    other = lib.gpupool_alloc(100, 1, ctypes.c_void_p(0x1234))
    stats = _native._capi_memory_stats(0)
    assert stats["allocation.all.current"] == len(sizes)
    assert _native._capi_memory_stats(1)["allocation.all.current"] == 1
    assert _native._capi_memory_stats(7) is None
    with pytest.raises(RuntimeError, match="still serves"):
        _native._capi_configure("host", "")
    for ptr, size in zip(ptrs, sizes, strict=True):
        lib.gpupool_free(ptr, size, 0, None)
    lib.gpupool_free(other, 100, 1, None)
    lib.gpupool_free(None, 0, 0, None)
    assert _native._capi_last_error() is None
    assert _native._capi_memory_stats(0)["allocation.all.current"] == 0
    lib.gpupool_free(ptrs[0], 1, 0, None)
    assert "not a live allocation" in _native._capi_last_error()
    assert _native._capi_last_error() is None
    assert not lib.gpupool_alloc(-5, 0, None)
    assert "negative" in _native._capi_last_error()
    assert _native._capi_empty_cache() > 0
    _native._capi_configure("host", "max_split_size_mb:64")
    with pytest.raises(ValueError):
        _native._capi_configure("tpu", "")


def test_a_child_forked_before_the_first_c_abi_pool_opens_its_own():
    # gpupool.torch.install() configures the pools before CUDA starts, and opens none: a worker
    # forked then (one that starts CUDA itself) has no parent's pools to be refused.
    code = textwrap.dedent(
        """
        import ctypes, os
        from gpupool import _native
        _native._capi_configure("host", "")
        assert _native._capi_memory_stats(0) is None
        lib = ctypes.CDLL(_native.__file__)
        lib.gpupool_alloc.restype = ctypes.c_void_p
        lib.gpupool_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        pid = os.fork()
        if pid == 0:
            served = lib.gpupool_alloc(64, 0, None)
            os._exit(0 if served else 1)
        assert os.waitpid(pid, 0)[1] == 0, "the child was refused"
        # Once a pool is open, a child is refused.
        assert lib.gpupool_alloc(64, 0, None)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if not lib.gpupool_alloc(64, 0, None) and "forked" in _native._capi_last_error() else 1)
        assert os.waitpid(pid, 0)[1] == 0, "the child used the parent's pool"
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


def test_the_extension_exports_the_c_functions():
    lib = ctypes.CDLL(_native.__file__)
    assert lib.gpupool_alloc and lib.gpupool_free


@pytest.mark.parametrize("module", ["torch", "cupy", "numba"])
def test_integrations_import_their_framework_lazily(module, monkeypatch):
    # A None entry in sys.modules makes the framework's import fail, as if it were not installed.
    monkeypatch.setitem(sys.modules, module, None)
    integration = importlib.import_module(f"gpupool.{module}")
    # A class built earlier in this process (where the framework is installed) is kept.
    for name in ("GpupoolMemoryManager", "_numba_memory_manager"):
        monkeypatch.delitem(vars(integration), name, raising=False)
    if module == "numba":
        # A module attribute that cannot exist is an AttributeError (hasattr() stays usable),
        # caused by the failed import.
        assert not hasattr(integration, "GpupoolMemoryManager")
        with pytest.raises(AttributeError, match="GpupoolMemoryManager needs Numba") as caught:
            integration.GpupoolMemoryManager  # noqa: B018
        assert isinstance(caught.value.__cause__, ImportError)
        return
    with pytest.raises(ImportError):
        if module == "torch":
            integration.install()
        else:
            integration.allocator(gpupool.Pool("host"))


def test_the_cupy_error_class_is_absent_without_cupy(monkeypatch):
    import gpupool.cupy

    # A class built earlier in this process (where CuPy is installed) is cached: forget it.
    gpupool.cupy._out_of_memory_class.cache_clear()
    monkeypatch.setitem(sys.modules, "cupy", None)  # an import of cupy now fails
    monkeypatch.setitem(sys.modules, "cupy.cuda", None)
    monkeypatch.setitem(sys.modules, "cupy.cuda.memory", None)
    assert not hasattr(gpupool.cupy, "CupyOutOfMemoryError")
    assert getattr(gpupool.cupy, "CupyOutOfMemoryError", "absent") == "absent"
    with pytest.raises(AttributeError, match="CupyOutOfMemoryError needs CuPy") as caught:
        gpupool.cupy.CupyOutOfMemoryError  # noqa: B018
    assert isinstance(caught.value.__cause__, ImportError)
