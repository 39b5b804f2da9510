"""One rank's collective as its header describes it, derived once (:class:`CollectiveCall`:
header, op record, dtype, encoding, geometry), and whether a wire format applies to a call
(:func:`check_encoding`). The hub's engine and the rank's stream both carry a
:class:`CollectiveCall`; nothing downstream re-validates the header or recomputes what it
holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gradstar.errors import ConfigurationError, GradstarError
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import DTypeInfo, dtype_from_wire, dtype_info, payload_bytes
from gradstar.wire.encoded import Encoding, carries
from gradstar.wire.formats import FORMATS, WireFormat, wire_format

from .geometry import Geometry
from .table import OPS, Facts, Op, geometry, op_record

#: Where a shared-memory segment's result region may start when it cannot share the input's:
#: past the input, at the next cache line.
_ALIGN = 64


def _listed(names: list[str], last: str = "and") -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"


def check_encoding(name: str | WireFormat | None, dtype, op: int, reduce_op: int,
                   chunk_elements: int | None = None, *,
                   error: type[GradstarError] = ConfigurationError) -> WireFormat | None:
    """The format called ``name`` (None: none), checked against the collective it is for
    (``chunk_elements``: the chunk size in elements, if already chosen).

    A wire format carries float tensors (float32, float64, float16, bfloat16; the hub reduces
    in float32) of the ops whose record takes one (all_reduce and reduce_scatter); the block
    formats (int8, int4) do not take ``op='prod'`` (their absolute error per block makes a
    product's relative error unbounded); a chunk holds whole blocks.

    Raises:
        ``error`` (ConfigurationError on a rank, before anything is sent; the hub passes
        InvalidCollectiveError): any of the above violated, or an unknown format.
    """
    if name is None:
        return None
    try:
        fmt = wire_format(name)
    except ConfigurationError as e:
        raise error(str(e)) from None
    info = dtype_info(dtype)
    if not carries(info.numpy):
        raise error(f"wire={fmt.name!r} carries float tensors; a {info.name} tensor travels "
                    "exactly in its own dtype (leave wire unset)")
    if not OPS[op].takes_wire:
        raise error(f"wire={fmt.name!r} applies to "
                    f"{_listed([o.name for o in OPS.values() if o.takes_wire])} only")
    if reduce_op == pb.REDUCE_OP_PROD and fmt.block:
        casts = [f.name for f in FORMATS.values() if not f.block]
        raise error(f"op='prod' does not take wire={fmt.name!r}: a block format's error is "
                    f"absolute, so a product's relative error is unbounded; use "
                    f"{_listed(casts, 'or')}")
    if fmt.block and chunk_elements is not None and chunk_elements % fmt.block:
        raise error(f"chunks of {chunk_elements} elements split {fmt.name}'s blocks of "
                    f"{fmt.block}; chunk_bytes must hold a multiple of {fmt.block} elements")
    return fmt


@dataclass(frozen=True)
class CollectiveCall:
    """One rank's collective, derived once from its header (:meth:`of`).

    ``geometry`` is the header's rank's (:func:`gradstar.ops.geometry`, its wire format
    included; an averaging round's result is never encoded); ``nbytes`` the rank's input in
    the tensor's own dtype.
    """

    header: pb.CollectiveHeader
    op: Op
    dtype: DTypeInfo
    encoding: Encoding | None
    geometry: Geometry
    nbytes: int
    world_size: int
    #: The header's :func:`call_fields`, computed once (the same for every header of the
    #: collective that agrees with this one: :meth:`for_header` keeps them). No default: a
    #: call built without them would pass any later header as agreeing.
    fields: tuple

    @classmethod
    def of(cls, header: pb.CollectiveHeader, world_size: int) -> CollectiveCall:
        """What ``header`` describes in a world of ``world_size`` ranks.

        Raises:
            InvalidCollectiveError: an unknown op.
            ProtocolError: an unknown dtype or wire format, or a shape too large to describe.
        """
        op = op_record(header.op)
        dtype = dtype_from_wire(header.dtype)
        encoding = Encoding.of_header(header)
        nbytes = payload_bytes(header.shape, header.dtype)
        g = geometry(header.op, world_size, header.rank, nbytes, header.chunk_bytes,
                     header.root, encoding, encode_out=not header.averaging.rule)
        return cls(header, op, dtype, encoding, g, nbytes, world_size, call_fields(header))

    def for_header(self, header: pb.CollectiveHeader) -> CollectiveCall:
        """This call for ``header``, which describes the same collective of the same rank (it
        differs in its sequence number, timeout, job or group only; the caller knows)."""
        # A copy of this frozen record's fields with its own header: what the dataclass's
        # __init__ would build, without setting each field through object.__setattr__ (once
        # per collective on the hub and on each rank).
        twin = object.__new__(CollectiveCall)
        twin.__dict__.update(self.__dict__, header=header)
        return twin

    @property
    def facts(self) -> Facts:
        """What the op's preconditions read (:func:`gradstar.ops.check_preconditions`)."""
        h = self.header
        return Facts(tuple(h.shape), self.dtype.name, self.world_size, h.root, h.rank)

    # -- the shared-memory in-place rule: the op record's ``in_place``, read here only ----------

    def result_offset(self) -> int:
        """Where a shared-memory segment's result region starts: on the input region itself
        when the op's result may overwrite its input (which halves the segment), else after
        the input region, cache-line aligned."""
        if self.op.in_place:
            return 0
        size = self.geometry.layout.total_bytes
        return size + (-size % _ALIGN)

    def result_fits(self, start: int, segment_bytes: int) -> bool:
        """Whether a segment of ``segment_bytes`` with its result region at ``start`` holds
        this call's input and result: apart, or the same region if the op allows it."""
        inputs = self.geometry.layout.total_bytes
        apart = start >= inputs or (start == 0 and self.op.in_place)
        return apart and start + self.geometry.out_layout.total_bytes <= segment_bytes


def geometry_of(header: pb.CollectiveHeader, world_size: int) -> Geometry:
    """The geometry of the header's rank (:attr:`CollectiveCall.geometry`).

    Raises:
        What :meth:`CollectiveCall.of` raises.
    """
    return CollectiveCall.of(header, world_size).geometry


def call_fields(h: pb.CollectiveHeader) -> tuple:
    """The fields of a header that say which collective it is, as they came (hashable): its
    op, reduce op, dtype, shape, root, wire format, chunk size, stripe and averaging spec; not
    which rank sends it, nor its job, group, seq or timeout."""
    a = h.averaging
    return (h.op, h.reduce_op, h.dtype, tuple(h.shape), h.root, h.wire, h.chunk_bytes,
            h.stripe, h.stripes, a.rule, a.model, a.outer_lr, a.outer_momentum)


#: How many distinct headers a :class:`CallCache` remembers.
CACHED_CALLS = 1024


class CallCache:
    """Calls derived from headers (``derive(header, world_size)``, :meth:`CollectiveCall.of`
    by default; the hub's derives with its checks), remembered by everything a call depends
    on: :func:`call_fields`, the rank, the world size and whether shared memory is offered. A
    training loop issues the same few collectives every step, and deriving each call again is a
    share of a tiny collective's Python worth saving (docs/performance.md, "Figures behind the
    code"). A header seen
    before gets the remembered call with its own header; one that ``derive`` refuses is
    derived (and refused) every time. At most ``size``, the oldest forgotten first."""

    def __init__(self, derive: Callable[[pb.CollectiveHeader, int], CollectiveCall] | None = None,
                 size: int = CACHED_CALLS) -> None:
        self._derive = derive or CollectiveCall.of
        self.size = size
        self._calls: dict[tuple, CollectiveCall] = {}

    def __len__(self) -> int:
        return len(self._calls)

    def call(self, h: pb.CollectiveHeader, world_size: int, key: tuple | None = None
             ) -> CollectiveCall:
        """The call ``h`` describes in a world of ``world_size``; raises what ``derive``
        raises. ``key``: what the caller built ``h`` from, when it knows that this alone
        tells its calls apart (a rank's group: the fields it set, in place of reading them
        back from the header) -- a tuple of another length than the four items of the key
        made here, so that the two kinds never meet."""
        if key is None:
            key = (call_fields(h), h.rank, world_size, h.HasField("shm"))
        known = self._calls.get(key)
        if known is not None:
            return known.for_header(h)
        call = self._derive(h, world_size)
        if len(self._calls) >= self.size:
            del self._calls[next(iter(self._calls))]
        self._calls[key] = call
        return call


__all__ = ["CACHED_CALLS", "CallCache", "CollectiveCall", "call_fields", "check_encoding",
           "geometry_of"]
