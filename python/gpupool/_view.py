"""``DevicePtr.view``: an allocation as a typed, shaped array for NumPy, CuPy, PyTorch and Numba."""

from __future__ import annotations

import math
import operator
from typing import Any

from gpupool._native import DevicePtr

# DLPack's type codes by the array-interface kind letter.
_DLPACK_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}

# Names accepted without NumPy; with NumPy, anything `numpy.dtype` understands is.
_NAMED_TYPES = {
    "bool": "|b1",
    "int8": "|i1",
    "uint8": "|u1",
    **{f"{kind}{bits}": f"<{kind[0]}{bits // 8}" for kind in ("int", "uint") for bits in (16, 32, 64)},
    **{f"float{bits}": f"<f{bits // 8}" for bits in (16, 32, 64)},
    "complex64": "<c8",
    "complex128": "<c16",
}


def _typestr(dtype: Any) -> str:
    """The array-interface type string (``<f4``) of ``dtype``: a NumPy dtype, type or name."""
    try:
        import numpy
    except ImportError:
        numpy = None
    if numpy is not None:
        typestr = numpy.dtype(dtype).str
    else:
        name = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", str(dtype))
        typestr = _NAMED_TYPES.get(name, name)
    if len(typestr) < 3 or typestr[0] not in "<|" or typestr[1] not in _DLPACK_CODES or not typestr[2:].isdigit():
        raise TypeError(f"unsupported dtype {dtype!r}: expected a little-endian bool, int, uint, float or complex type")
    return typestr


def _extents(shape: Any) -> tuple[int, ...]:
    """``shape`` as NumPy reads one: an integer or a sequence of them. A string would iterate as
    digits ("12" as (1, 2)) and ``int()`` would cut a float short, so both are refused."""
    try:
        return (_extent(shape, shape),)
    except TypeError:
        if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
            raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    return tuple(_extent(extent, shape) for extent in shape)


def _extent(value: Any, shape: Any) -> int:
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"shape {shape!r} has an extent that is not an int: {value!r}")
    return operator.index(value)


class View:
    """``shape`` elements of ``dtype`` at the start of ``ptr``, C-contiguous.

    It speaks ``__array_interface__`` (host memory), ``__cuda_array_interface__`` (CUDA memory) and
    DLPack (both), so ``numpy.asarray``, ``numpy.from_dlpack``, ``cupy.asarray``,
    ``torch.from_dlpack`` and ``numba.cuda.as_cuda_array`` wrap it without copying. A view is an
    export: while it (or an array made from it) is alive, its bytes are neither reused nor unmapped,
    even after ``ptr.free()``.
    """

    # Read-only: the interfaces pair the export's address with these, so a shape or type set
    # later could describe bytes past the allocation (and numpy would write there).
    __slots__ = ("_ptr", "_typestr", "_shape", "_export")

    def __init__(self, ptr: DevicePtr, dtype: Any, shape: int | tuple[int, ...] | None = None) -> None:
        typestr = _typestr(dtype)
        itemsize = int(typestr[2:])
        shape = (ptr.size // itemsize,) if shape is None else _extents(shape)
        if any(extent < 0 for extent in shape):
            raise ValueError(f"shape {shape} has a negative extent")
        if math.prod(shape) * itemsize > ptr.size:
            raise ValueError(f"shape {shape} of {typestr} needs more than the {ptr.size} bytes allocated")
        for name, value in (("_ptr", ptr), ("_typestr", typestr), ("_shape", shape), ("_export", ptr._export())):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a View is read-only (make another with ptr.view): cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a View is read-only: cannot delete {name!r}")

    @property
    def ptr(self) -> DevicePtr:
        """The allocation viewed."""
        return self._ptr

    @property
    def typestr(self) -> str:
        """The element type as an array-interface type string, such as ``<f4``."""
        return self._typestr

    @property
    def shape(self) -> tuple[int, ...]:
        """The extents of each dimension; the elements lie C-contiguous."""
        return self._shape

    @property
    def nbytes(self) -> int:
        """Bytes the view covers: its element count times the element size."""
        return math.prod(self.shape) * int(self.typestr[2:])

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {**self._export.__array_interface__, "shape": self.shape, "typestr": self.typestr}

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Any:
        # NumPy takes an error from ``__array_interface__`` for "no interface" and comes here: say
        # why, where it would otherwise wrap the view in a 0-d object array.
        try:
            self._export.__array_interface__  # noqa: B018 - raises for memory the host cannot read
        except AttributeError as e:
            raise TypeError(str(e)) from None
        import numpy

        return numpy.array(self, dtype=dtype, copy=copy)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {**self._export.__cuda_array_interface__, "shape": self.shape, "typestr": self.typestr}

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.ptr.__dlpack_device__()

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        if copy:
            raise BufferError("gpupool exports memory without copying")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"cannot export memory of '{self.ptr.device}' to {dl_device}")
        code = _DLPACK_CODES[self.typestr[1]]
        bits = 8 * int(self.typestr[2:])
        return self._export._dlpack(code, bits, list(self.shape), stream, max_version)

    def __repr__(self) -> str:
        return f"View({self.ptr!r}, dtype={self.typestr!r}, shape={self.shape})"
