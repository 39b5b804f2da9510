"""Header checks of the collective engine: is a header valid on its own, and does it agree with
the first header of its collective? Pure functions, no asyncio, no sockets.

Why always on: every rank must issue the same collectives in the same order (as in NCCL). A
rank that calls ``all_reduce`` while another calls ``broadcast``, or passes another shape, would
otherwise get a silently wrong tensor or a hang; here it gets a
:class:`~gradstar.errors.CollectiveMismatchError` naming both ranks, what each called and the
field that differs.

Why before allocating: the engine sizes accumulators and chunk trackers from the header, so a
header is checked against the hub's limits (payload bytes, chunk size) before anything is
allocated for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradstar import ops
from gradstar.errors import (
    CollectiveMismatchError,
    InvalidCollectiveError,
    PayloadTooLargeError,
    ProtocolError,
)
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import check_chunk_count, check_shape, dtype_from_wire, payload_bytes
from gradstar.wire.formats import format_from_wire


@dataclass(frozen=True)
class Limits:
    """What the hub accepts (coordinator settings ``max_*``)."""

    max_tensor_bytes: int
    max_chunk_bytes: int


def dtype_name(wire: int) -> str:
    try:
        return dtype_from_wire(wire).name
    except ProtocolError:
        return f"dtype {wire}"


def wire_name(wire: int) -> str | None:
    """A header's wire format by name (None: the tensor's own dtype)."""
    try:
        fmt = format_from_wire(wire)
    except ProtocolError:
        return f"wire format {wire}"
    return None if fmt is None else fmt.name


def describe(h: pb.CollectiveHeader) -> str:
    """A header as a user would have written the call, for error messages."""
    op = ops.OPS.get(h.op)
    if op is not None and op.shown_as is not None:
        # Its header describes something else (all_to_all: the plan, not the user's tensors,
        # which the ranks check).
        return op.shown_as
    parts = [f"dtype={dtype_name(h.dtype)}", f"shape={tuple(h.shape)}"]
    if op is not None and op.reduces:
        parts.insert(0, f"op={ops.REDUCE_OP_NAMES.get(h.reduce_op, h.reduce_op)!r}")
    if op is not None and op.rooted:
        parts.append(f"src={h.root}")
    if h.wire:
        parts.append(f"wire={wire_name(h.wire)!r}")
    return f"{ops.op_name(h.op)}({', '.join(parts)})"


def field_values(h: pb.CollectiveHeader) -> list[tuple[str, object]]:
    """(field name, value) pairs every rank of a collective must agree on, in the order a
    disagreement is reported."""
    op = ops.OPS.get(h.op)
    values: list[tuple[str, object]] = [("op", ops.OP_NAMES.get(h.op, h.op))]
    if op is not None and op.reduces:
        values.append(("reduce op", ops.REDUCE_OP_NAMES.get(h.reduce_op, h.reduce_op)))
    values += [("dtype", dtype_name(h.dtype)), ("shape", tuple(h.shape))]
    if op is not None and op.rooted:
        values.append(("root", h.root))
    values.append(("wire", wire_name(h.wire)))
    values.append(("chunk_bytes", h.chunk_bytes))
    values.append(("stripe", (h.stripe, max(1, h.stripes))))
    a = h.averaging
    values.append(("averaging", (a.model, ops.RULE_NAMES.get(a.rule, a.rule), a.outer_lr,
                                 a.outer_momentum) if a.rule else None))
    return values


def validate(h: pb.CollectiveHeader, world_size: int, limits: Limits) -> ops.CollectiveCall:
    """Check a header on its own; return what it describes, derived once.

    Raises:
        InvalidCollectiveError: unknown op, bad chunk size, an averaging round that is not a
            float32 mean all_reduce, a stripe out of range, a precondition of the op's record
            (:func:`gradstar.ops.check_preconditions`: broadcast's root in range,
            reduce_scatter's dim 0 divisible by the world size, an all_to_all plan of int64
            and shape (:func:`gradstar.ops.plan_length`,)), or a wire format where
            :func:`gradstar.ops.check_encoding` refuses it, or with shared memory.
        PayloadTooLargeError: the payload is over ``limits.max_tensor_bytes``.
        ProtocolError: unknown dtype or wire format.
    """
    op = ops.op_record(h.op)
    check_shape(h.shape, f"rank {h.rank}")
    info = dtype_from_wire(h.dtype)
    cb = h.chunk_bytes
    if not 0 < cb <= limits.max_chunk_bytes or cb % info.numpy.itemsize:
        raise InvalidCollectiveError(
            f"chunk_bytes {h.chunk_bytes} must be a multiple of the element size "
            f"{info.numpy.itemsize} and at most {limits.max_chunk_bytes}"
        )
    if h.wire:
        _validate_wire(h, info)
    nbytes = payload_bytes(h.shape, h.dtype)
    if nbytes > limits.max_tensor_bytes:
        raise PayloadTooLargeError(
            f"rank {h.rank} sent a {describe(h)} payload of {nbytes} bytes, over the "
            f"coordinator's limit of {limits.max_tensor_bytes} bytes "
            "(coordinator setting max_tensor_bytes)"
        )
    call = ops.CollectiveCall.of(h, world_size)
    check_chunk_count(call.geometry.layout.count, nbytes, cb, f"rank {h.rank}")
    if h.averaging.rule and (h.op != ops.ALL_REDUCE or h.dtype != pb.DTYPE_FLOAT32
                             or h.reduce_op != pb.REDUCE_OP_MEAN):
        raise InvalidCollectiveError(
            f"an averaging round must be an all_reduce with op='mean' of float32, got "
            f"{describe(h)}"
        )
    if h.stripes > 1 and h.stripe >= h.stripes:
        raise InvalidCollectiveError(
            f"rank {h.rank} sent stripe {h.stripe} of a collective striped {h.stripes} ways")
    ops.check_preconditions(op.wire, call.facts)
    return call


def _validate_wire(h: pb.CollectiveHeader, info) -> None:
    name = wire_name(h.wire)
    format_from_wire(h.wire)  # an unknown value is a ProtocolError
    ops.check_encoding(name, info.numpy, h.op, h.reduce_op,
                       h.chunk_bytes // info.numpy.itemsize, error=InvalidCollectiveError)
    # Shared memory carries payloads in the tensor's own dtype.
    if h.HasField("shm"):
        raise InvalidCollectiveError(
            f"rank {h.rank} sent {describe(h)} with shared memory; a wire format travels in "
            "frames")


class ValidatedCalls(ops.CallCache):
    """:func:`validate`'s successes, remembered (:class:`gradstar.ops.CallCache`; the limits
    are the engine's): a header seen before is not derived nor checked again."""

    def __init__(self, limits: Limits, size: int = ops.CACHED_CALLS) -> None:
        super().__init__(lambda h, world_size: validate(h, world_size, limits), size)


def check_agrees(h: pb.CollectiveHeader, first: pb.CollectiveHeader, job: str) -> None:
    """Check that rank ``h.rank``'s header agrees with the collective's first header.

    Raises:
        CollectiveMismatchError: naming both ranks, both calls and the first field that
            differs (``op`` first: other fields mean different things for different ops).
    """
    if ops.call_fields(h) == ops.call_fields(first):  # the usual case, naming nothing
        return
    pairs = zip(field_values(h), field_values(first), strict=False)
    differing = "op" if h.op != first.op else next(
        (name for (name, mine), (_, theirs) in pairs if mine != theirs), None)
    if differing is not None:
        raise CollectiveMismatchError(
            f"ranks disagree on collective seq {h.seq} of job {job!r} "
            f"(group {h.group!r}): rank {h.rank} called {describe(h)} but rank "
            f"{first.rank} called {describe(first)} ({differing} differs); every rank must "
            "issue the same collectives in the same order",
            rank=h.rank, field=differing,
        )
