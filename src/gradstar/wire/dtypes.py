"""What a tensor is on the wire: its dtype (name, wire enum, numpy dtype, the dtype the hub
reduces in), its shape (bounded before any arithmetic on it) and its size in bytes."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from gradstar.errors import ConfigurationError, InvalidCollectiveError, ProtocolError
from gradstar.proto.v1 import collective_pb2 as pb

#: Most dimensions a tensor may have (as many as torch allows), checked before any arithmetic
#: on a shape that comes from a header.
MAX_NDIM = 64


@dataclass(frozen=True)
class DTypeInfo:
    """One supported dtype: its name, wire enum, numpy dtype and the dtype the hub reduces in."""

    name: str
    wire: int
    numpy: np.dtype
    accumulate: np.dtype


_DTYPES = [
    DTypeInfo("float32", pb.DTYPE_FLOAT32, np.dtype(np.float32), np.dtype(np.float32)),
    DTypeInfo("float64", pb.DTYPE_FLOAT64, np.dtype(np.float64), np.dtype(np.float64)),
    # Half precision is reduced in float32 so sums over many ranks do not lose precision.
    DTypeInfo("float16", pb.DTYPE_FLOAT16, np.dtype(np.float16), np.dtype(np.float32)),
    DTypeInfo("int32", pb.DTYPE_INT32, np.dtype(np.int32), np.dtype(np.int32)),
    DTypeInfo("int64", pb.DTYPE_INT64, np.dtype(np.int64), np.dtype(np.int64)),
]
_BY_NUMPY = {d.numpy: d for d in _DTYPES}
_BY_WIRE = {d.wire: d for d in _DTYPES}
SUPPORTED_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")


@functools.cache
def bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16, imported on first use: the import is two thirds of ``import
    gradstar`` (0.65 s of CPU), which a rank that never sees a bfloat16 need not pay."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


@functools.cache
def _bfloat16_info() -> DTypeInfo:
    """bfloat16's :class:`DTypeInfo`, entered in the lookup tables on first use."""
    info = DTypeInfo("bfloat16", pb.DTYPE_BFLOAT16, bfloat16(), np.dtype(np.float32))
    _BY_NUMPY[info.numpy] = _BY_WIRE[info.wire] = info
    return info


def _names_bfloat16(dtype) -> bool:
    """Whether ``dtype`` (a dtype, a type or a name) is bfloat16, without importing it."""
    return (getattr(dtype, "__name__", None) or str(dtype)) == "bfloat16"


def check_shape(shape, who: str) -> tuple[int, ...]:
    """``shape`` as a tuple, refused before any arithmetic on it if it has over
    :data:`MAX_NDIM` dimensions.

    Raises:
        InvalidCollectiveError: too many dimensions.
    """
    if len(shape) > MAX_NDIM:
        raise InvalidCollectiveError(
            f"{who} sent a shape of {len(shape)} dimensions; at most {MAX_NDIM} are supported")
    return tuple(shape)


def payload_bytes(shape, dtype_wire: int) -> int:
    """Bytes of a tensor of ``shape`` in wire dtype ``dtype_wire``; check the shape with
    :func:`check_shape` first where it comes from outside.

    Raises:
        ProtocolError: unknown dtype.
    """
    return math.prod(shape) * dtype_from_wire(dtype_wire).numpy.itemsize


def dtype_info(dtype: np.dtype) -> DTypeInfo:
    """The :class:`DTypeInfo` of a numpy dtype; raises ConfigurationError if unsupported."""
    try:
        return _BY_NUMPY[np.dtype(dtype)]
    except (KeyError, TypeError):
        if _names_bfloat16(dtype):
            return _bfloat16_info()
        raise ConfigurationError(
            f"dtype {dtype} is not supported; use one of {', '.join(SUPPORTED_DTYPES)}"
        ) from None


def numpy_dtype_name(dtype: np.dtype) -> str:
    """A numpy dtype's name: its :class:`DTypeInfo`'s for a supported one (a lookup; numpy's
    own ``str(dtype)`` runs Python code each time), numpy's for any other."""
    info = _BY_NUMPY.get(dtype)
    return info.name if info is not None else str(dtype)


def dtype_from_wire(wire: int) -> DTypeInfo:
    """The :class:`DTypeInfo` of a wire enum value; raises ProtocolError if unknown."""
    try:
        return _BY_WIRE[wire]
    except KeyError:
        if wire == pb.DTYPE_BFLOAT16:
            return _bfloat16_info()
        raise ProtocolError(f"unknown dtype {wire} in collective header") from None



__all__ = ["MAX_NDIM", "SUPPORTED_DTYPES", "DTypeInfo", "bfloat16", "check_shape",
           "dtype_from_wire",
           "dtype_info", "numpy_dtype_name", "payload_bytes"]
