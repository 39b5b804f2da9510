"""How gradstar's torch.distributed backend reads torch's arguments and moves torch's tensors.

float32/64, float16, bfloat16, int32 and int64 travel as they are. Other dtypes travel as raw
bytes in collectives that only move data (broadcast, gathers, send/recv) and widened to int32 in
reductions (bool, int8, uint8, int16); complex tensors reduce as their real view for SUM and AVG.
BAND, BOR and BXOR reduce integer and bool tensors on the client (see :func:`bitwise_reduce`).
Sparse tensors are refused.

**Devices.** Tensors live on the CPU or on a CUDA device; any other device (mps, xpu, meta, ...)
is refused, named. The conversions here run on the tensor's own device, in the caller's thread
and on its current stream (gradstar's SDK copies a CUDA tensor to host memory when a collective
is called, see :mod:`gradstar.client.device`), so nothing reads a CUDA tensor later or
elsewhere. :func:`cuda_devices` names the devices whose streams a collective synchronizes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from gradstar.client.device import check_device
from gradstar.errors import ConfigurationError, InvalidCollectiveError

ReduceOp = dist.ReduceOp
_REDUCE_OPS = [(ReduceOp.SUM, "sum"), (ReduceOp.AVG, "mean"), (ReduceOp.MIN, "min"),
               (ReduceOp.MAX, "max"), (ReduceOp.PRODUCT, "prod"), (ReduceOp.BAND, "band"),
               (ReduceOp.BOR, "bor"), (ReduceOp.BXOR, "bxor")]
# The hub reduces sum/mean/min/max/prod only; these the client reduces itself from an all_gather.
BITWISE_OPS = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}
_LABELS = {name: f"ReduceOp.{torch_op.name}" for torch_op, name in _REDUCE_OPS}
_NATIVE = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64}
_WIDENED = {torch.bool, torch.uint8, torch.int8, torch.int16}
_COMPLEX = {torch.complex64, torch.complex128}


def op_label(op) -> str:
    """How torch spells a ``ReduceOp`` (``"ReduceOp.BAND"``), for messages."""
    kind = getattr(op, "op", op)  # a ReduceOp object wraps its RedOpType in .op
    name = getattr(kind, "name", None)
    return f"ReduceOp.{name}" if isinstance(name, str) else repr(op)


def reduce_op_name(op) -> str:
    """gradstar's name for a torch ``ReduceOp`` (or options object carrying ``reduceOp``):
    one of the hub's ops, or a key of :data:`BITWISE_OPS`.

    Raises:
        ConfigurationError: PREMUL_SUM, or an op torch added after this backend was written.
    """
    op = getattr(op, "reduceOp", op)
    if op is None:
        return "sum"
    for torch_op, name in _REDUCE_OPS:
        if op == torch_op:
            return name
    if op == ReduceOp.PREMUL_SUM:
        raise ConfigurationError(
            "ReduceOp.PREMUL_SUM is not supported by the gradstar backend: torch does not expose "
            "its scale factor to Python backends; multiply the tensor by the factor and use "
            "ReduceOp.SUM"
        )
    raise ConfigurationError(
        f"{op_label(op)} is not supported by the gradstar backend: it reduces with SUM, AVG, "
        "MIN, MAX, PRODUCT, BAND, BOR and BXOR"
    )


def seconds_of(opts) -> float | None:
    """The per-call timeout torch put in ``opts``, or None (use the group's)."""
    timeout = getattr(opts, "timeout", None)
    if isinstance(timeout, timedelta) and timeout > timedelta(0):
        return timeout.total_seconds()
    return None


def caller_waits(opts) -> bool:
    """Whether torch's caller waits for the Work at once: ``opts.asyncOp`` is False (torch's
    ``dist.all_reduce(t)``, ``dist.barrier()``, ... without ``async_op=True``; torch's options
    default to True, as DDP's and FSDP's own calls leave them)."""
    return getattr(opts, "asyncOp", True) is False


@dataclass(frozen=True)
class CallOptions:
    """What torch's options say of one call: its timeout in seconds (None: the group's,
    :func:`seconds_of`) and whether its Work is settled on the caller's thread, as the caller
    waits for it at once (:func:`caller_waits`)."""

    timeout: float | None = None
    settle: bool = False

    @classmethod
    def of(cls, opts) -> CallOptions:
        return cls(seconds_of(opts), caller_waits(opts))


def tensor_list(tensors) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def tensors_in(value) -> list[torch.Tensor]:
    """The tensors in ``value``: a tensor, or (nested) lists and tuples of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in tensors_in(item)]
    return []


def cuda_devices(value) -> list[torch.device]:
    """The CUDA devices of the tensors in ``value`` (see :func:`tensors_in`), each once, in
    index order: where a collective over them must order its copies with the caller's streams
    and synchronize its results."""
    devices = {t.device for t in tensors_in(value) if t.is_cuda}
    return sorted(devices, key=lambda device: device.index)


def check_dense(t: torch.Tensor) -> None:
    """Accept a dense tensor on the CPU or a CUDA device.

    Raises:
        ConfigurationError: ``t`` is sparse, or lives on another device (mps, xpu, meta, ...),
            which the message names.
    """
    if t.layout != torch.strided:
        raise ConfigurationError(
            f"the gradstar backend moves dense (torch.strided) tensors; sparse layouts such as "
            f"this tensor's {t.layout} are not supported: call .to_dense() first"
        )
    check_device(t)


Restore = Callable[[torch.Tensor], torch.Tensor]


def for_transfer(t: torch.Tensor) -> tuple[torch.Tensor, Restore]:
    """``t`` in a dtype gradstar moves, and how to turn a received tensor back into t's kind."""
    check_dense(t)
    if t.dtype in _NATIVE:
        return t, lambda r: r
    # Raw bytes, padded to whole int32 words: every rank pads the same tensor shape alike.
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    size, pad = raw.numel(), -raw.numel() % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    dtype, shape = t.dtype, t.shape

    def restore(r: torch.Tensor) -> torch.Tensor:
        return r.reshape(-1).view(torch.uint8)[:size].view(dtype).reshape(shape)

    return raw.view(torch.int32), restore


def rows_for_transfer(t: torch.Tensor) -> tuple[torch.Tensor,
                                                Callable[[torch.Tensor, torch.Tensor], None]]:
    """``t`` (1-d or more) in a dtype gradstar moves with its rows (dim 0) kept, and how to
    write rows received in that form into an output tensor of t's dtype.

    Native dtypes move as they are. Others move as rows of raw bytes, each padded to whole
    int32 words (rows of one size pad alike on every rank), so splits along dim 0 still work.
    """
    check_dense(t)
    if t.dim() == 0:
        raise InvalidCollectiveError("all_to_all_single needs tensors of at least 1 dimension")
    if t.dtype in _NATIVE:
        def write(received: torch.Tensor, output: torch.Tensor) -> None:
            output.copy_(received.reshape(output.shape))

        return t.detach(), write
    rows = t.detach().contiguous().reshape(t.shape[0], -1).view(torch.uint8)
    row_bytes, pad = rows.shape[1], -rows.shape[1] % 4
    if pad:
        rows = torch.cat([rows, rows.new_zeros((rows.shape[0], pad))], dim=1)

    def write(received: torch.Tensor, output: torch.Tensor) -> None:
        raw = received.reshape(received.shape[0], -1).view(torch.uint8)[:, :row_bytes]
        output.copy_(raw.contiguous().view(output.dtype).reshape(output.shape))

    return rows.view(torch.int32), write


def for_reduction(t: torch.Tensor, op: str) -> tuple[torch.Tensor, Restore]:
    """``t`` in a dtype the hub reduces, and how to turn a result back into t's dtype.

    Raises:
        ConfigurationError: a dtype gradstar cannot reduce with ``op``.
    """
    check_dense(t)
    if t.dtype in _NATIVE:
        return t, lambda r: r
    if t.dtype in _WIDENED and op != "mean":
        dtype = t.dtype
        return t.to(torch.int32), lambda r: r.to(dtype)
    if t.dtype in _COMPLEX and op in ("sum", "mean"):
        return torch.view_as_real(t.detach()), torch.view_as_complex
    raise ConfigurationError(
        f"the gradstar backend cannot reduce {t.dtype} tensors with {_LABELS.get(op, op)}")


def for_bitwise(t: torch.Tensor, op: str) -> torch.Tensor:
    """``t``, checked for a bitwise reduction (:data:`BITWISE_OPS`).

    Raises:
        ConfigurationError: ``t`` is a floating point or complex tensor, or sparse.
    """
    check_dense(t)
    if t.is_floating_point() or t.is_complex():
        raise ConfigurationError(
            f"{_LABELS[op]} reduces integer and bool tensors, not {t.dtype} tensors")
    return t


def bitwise_reduce(parts: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Every rank's tensor (from an all_gather) reduced with the bitwise ``op``.

    Exact, and done alike on every rank; it costs an all_gather (world x the data on the wire
    instead of a reduction's 2x), which suits the small integer and bool tensors these ops are
    used on (flags, masks).
    """
    return functools.reduce(BITWISE_OPS[op], parts)


def write_rows(output: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """Write ``parts`` one after the other into ``output`` (all_gather_into_tensor's layout)."""
    target = output if output.is_contiguous() else torch.empty_like(
        output, memory_format=torch.contiguous_format)
    rows = target.view(len(parts), -1)
    for row, part in zip(rows, parts, strict=True):
        row.copy_(part.reshape(-1))
    if target is not output:
        output.copy_(target)


def check_numel(what: str, got: int, want: int) -> None:
    if got != want:
        raise InvalidCollectiveError(f"{what} has {got} elements, expected {want}")


__all__ = [
    "BITWISE_OPS",
    "CallOptions",
    "Restore",
    "bitwise_reduce",
    "caller_waits",
    "check_dense",
    "check_numel",
    "cuda_devices",
    "for_bitwise",
    "for_reduction",
    "for_transfer",
    "op_label",
    "reduce_op_name",
    "rows_for_transfer",
    "seconds_of",
    "tensor_list",
    "tensors_in",
    "write_rows",
]
