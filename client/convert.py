"""numpy arrays and torch tensors in, the same type out, without copying where possible.

CPU tensors are viewed as numpy arrays; CUDA tensors are copied to host memory when the call is
made and their results copied back to their device (see :mod:`gradstar.client.device`).

Collectives restore a result to the caller's type with the function :func:`to_numpy` returns; a
peer message carries its type across as an ``ArrayKind`` (:func:`array_kind`,
:func:`restore_array`).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

from gradstar.errors import ConfigurationError, InvalidCollectiveError
from gradstar.proto.v1 import peer_pb2 as ppb
from gradstar.wire import bfloat16, dtype_info

from .device import caller_stream, check_device, is_staged, to_device, to_host_array

if TYPE_CHECKING:
    import torch

#: What a collective takes and returns: a numpy array or a torch tensor (the result is of the
#: input's type).
ArrayLike: TypeAlias = "np.ndarray | torch.Tensor"
Restore = Callable[[np.ndarray], object]


def _is_torch_tensor(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_cpu_tensor(x) -> bool:
    """Whether ``x`` is a torch tensor whose memory numpy can view (on the CPU, not staged)."""
    return _is_torch_tensor(x) and x.is_cpu and not is_staged(x)


def to_numpy(x) -> tuple[np.ndarray, Restore]:
    """A C-contiguous numpy view of ``x`` and a function turning a result back into x's type.

    Raises:
        ConfigurationError: ``x`` is not a numpy array or a CPU or CUDA tensor, or its dtype
            is unsupported.
    """
    if isinstance(x, np.ndarray):
        # Not np.ascontiguousarray: it turns a 0-d array into a 1-d one.
        arr = x if x.flags.c_contiguous else x.copy(order="C")
        restore: Restore = _same
    elif _is_torch_tensor(x):
        arr, restore = _torch_to_numpy(x)
    else:
        raise ConfigurationError(
            f"expected a numpy array or a torch tensor, got {type(x).__name__}"
        )
    dtype_info(arr.dtype)
    return arr, restore


def _same(a: np.ndarray) -> np.ndarray:
    return a


def _torch_to_numpy(t) -> tuple[np.ndarray, Restore]:
    import torch

    check_device(t)
    if is_staged(t):
        return _staged_to_numpy(t)
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        # numpy has no bfloat16: reinterpret the same bits as ml_dtypes.bfloat16.
        arr = t.view(torch.int16).numpy().view(bfloat16())

        def restore(a: np.ndarray):
            a = a if a.flags.c_contiguous else a.copy(order="C")  # keeps 0-d arrays 0-d
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)

        return arr, restore
    return t.numpy(), torch.from_numpy


def _staged_to_numpy(t) -> tuple[np.ndarray, Restore]:
    """A host copy of the device tensor ``t`` as numpy, and a restore that copies a result back
    to t's device, on the stream that is current now (see :mod:`gradstar.client.device`)."""
    import torch

    device, bf16 = t.device, t.dtype == torch.bfloat16
    stream = caller_stream(device)
    arr = to_host_array(t)
    if bf16:
        arr = arr.view(bfloat16())

    def restore(a: np.ndarray):
        a = a if a.flags.c_contiguous else a.copy(order="C")
        on_host = torch.from_numpy(a.view(np.int16) if bf16 else a)
        on_device = to_device(on_host, device, stream=stream)
        return on_device.view(torch.bfloat16) if bf16 else on_device

    return arr, copying_to_device(restore)


def copying_to_device(restore: Restore, copies: bool = True) -> Restore:
    """``restore``, marked as one that copies to a device when ``copies``: it blocks until
    the copy is done (and the caller's stream with it), so the process group runs it on a
    worker thread, never on its event loop (:func:`copies_to_device`)."""
    if copies:
        restore.copies_to_device = True  # type: ignore[attr-defined]
    return restore


def copies_to_device(restore: Restore) -> bool:
    """Whether ``restore`` was marked by :func:`copying_to_device`."""
    return getattr(restore, "copies_to_device", False)


async def delivered(restore: Restore, value):
    """``restore(value)``: what the caller gets. A restore that copies to a GPU blocks until
    the copy and the caller's stream are done, so it runs on a worker thread: the event loop
    keeps driving every other collective, peer message and heartbeat meanwhile (and a caller
    whose stream waits for another of this rank's collectives cannot deadlock it)."""
    if copies_to_device(restore):
        return await asyncio.to_thread(restore, value)
    return restore(value)


def array_kind(x) -> int:
    """The ArrayKind of a value ``to_numpy`` accepted."""
    return ppb.ARRAY_KIND_NUMPY if isinstance(x, np.ndarray) else ppb.ARRAY_KIND_TORCH


def restore_array(arr: np.ndarray, kind: int):
    """``arr`` as the type the sender passed: a torch tensor for ARRAY_KIND_TORCH when torch
    is installed here, else the numpy array."""
    if kind != ppb.ARRAY_KIND_TORCH:
        return arr
    try:
        import torch
    except ImportError:
        return arr
    if arr.dtype.name == "bfloat16":
        # numpy has no bfloat16: hand torch the same bits as int16 and reinterpret them.
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def output_array(out, like: np.ndarray) -> np.ndarray:
    """``out`` as a numpy array sharing its memory, checked against the input ``like``.

    Raises:
        ConfigurationError: not a writable C-contiguous numpy array or CPU tensor.
        InvalidCollectiveError: another shape or dtype than ``like``.
    """
    arr = None
    if isinstance(out, np.ndarray):
        arr = out
    elif is_cpu_tensor(out) and out.is_contiguous():
        arr, _ = to_numpy(out)  # a view of the tensor's memory
    if arr is None or not (arr.flags.c_contiguous and arr.flags.writeable):
        raise ConfigurationError(
            "out= takes a writable, C-contiguous numpy array or CPU tensor, got "
            f"{type(out).__name__}" + (f" on {out.device}" if hasattr(out, "device") else ""))
    if arr.shape != like.shape or arr.dtype != like.dtype:
        raise InvalidCollectiveError(
            f"out= must match the input: shape {like.shape} and dtype {like.dtype}, got shape "
            f"{arr.shape} and dtype {arr.dtype}")
    return arr
