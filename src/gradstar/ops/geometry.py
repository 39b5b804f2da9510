"""What each collective means: names <-> wire enums, and which chunks every rank sends and
receives. The hub (``gradstar.coordinator``) and the ranks (``gradstar.client``) both read this
one table, so the two halves of the protocol cannot drift apart.

Geometry. A collective's tensor is cut by a :class:`~gradstar.wire.ChunkLayout` (the *input
layout*); a chunk index always refers to it. For each op:

============== ============================ ===================== ===========================
op             input layout                 rank r sends          rank r receives
============== ============================ ===================== ===========================
all_reduce     1 segment of the tensor      every chunk           every chunk, reduced
broadcast      1 segment of the tensor      every chunk if root   every chunk unless root
all_gather     world segments of r's input  segment r             every segment but r
reduce_scatter world segments (dim 0 split) every chunk           segment r, reduced
barrier        no chunks                    nothing               nothing
all_to_all     world segments of r's plan   segment r             every segment but r
============== ============================ ===================== ===========================

all_to_all carries only the ranks' plans through the hub (the geometry of all_gather: every
rank gets every plan and checks them alike); its payload rides the ranks' peer streams (see
``gradstar.client.all_to_all``).

A received chunk is written at its place in the rank's result (the *output layout*): the same
layout for all_reduce, broadcast and all_gather; for reduce_scatter, one segment, where input
chunk ``i`` of segment ``r`` becomes output chunk ``i - r * per_segment`` (that output index is
what travels on the wire).

Stripes. With K hub shards, chunk ``i`` is carried by shard ``i % K`` (:func:`stripe_of`); a
collective with fewer chunks than shards uses only the first ones (:func:`active_shards`), so a
small tensor costs one round trip to one shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradstar.errors import ConfigurationError
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import ChunkLayout, payload_bytes
from gradstar.wire.encoded import Encoding

ALL_REDUCE = pb.COLLECTIVE_OP_ALL_REDUCE
BROADCAST = pb.COLLECTIVE_OP_BROADCAST
ALL_GATHER = pb.COLLECTIVE_OP_ALL_GATHER
REDUCE_SCATTER = pb.COLLECTIVE_OP_REDUCE_SCATTER
BARRIER = pb.COLLECTIVE_OP_BARRIER
ALL_TO_ALL = pb.COLLECTIVE_OP_ALL_TO_ALL

#: wire enum -> name, for every collective op.
OP_NAMES = {
    ALL_REDUCE: "all_reduce",
    BROADCAST: "broadcast",
    ALL_GATHER: "all_gather",
    REDUCE_SCATTER: "reduce_scatter",
    BARRIER: "barrier",
    ALL_TO_ALL: "all_to_all",
}
#: Ops whose chunks the hub reduces (the others it forwards unchanged).
REDUCING = frozenset((ALL_REDUCE, REDUCE_SCATTER))

#: wire enum -> name of every reduce op.
REDUCE_OP_NAMES = {
    pb.REDUCE_OP_SUM: "sum",
    pb.REDUCE_OP_MEAN: "mean",
    pb.REDUCE_OP_MIN: "min",
    pb.REDUCE_OP_MAX: "max",
    pb.REDUCE_OP_PROD: "prod",
}
#: name a caller may pass -> wire enum ("avg" is torch's name for the mean).
REDUCE_OPS = {**{name: wire for wire, name in REDUCE_OP_NAMES.items()}, "avg": pb.REDUCE_OP_MEAN}

#: wire enum -> name of every parameter-averaging rule (see gradstar.coordinator.rounds.averaging).
RULE_NAMES = {
    pb.AVERAGING_RULE_SEED: "seed",
    pb.AVERAGING_RULE_AVERAGE: "average",
    pb.AVERAGING_RULE_OUTER_SGD: "outer_sgd",
    pb.AVERAGING_RULE_OUTER_NESTEROV: "outer_nesterov",
}
AVERAGING_RULES = {name: wire for wire, name in RULE_NAMES.items()}


def op_name(op: int) -> str:
    """A collective op's name, or ``"op N"`` for an unknown wire value."""
    return OP_NAMES.get(op, f"op {op}")


def reduce_op(name: str) -> int:
    """The wire enum of a reduce op name.

    Raises:
        ConfigurationError: an unknown name.
    """
    return _named(REDUCE_OPS, name, "reduce op")


def averaging_rule(name: str) -> int:
    """The wire enum of an averaging rule name.

    Raises:
        ConfigurationError: an unknown name.
    """
    return _named(AVERAGING_RULES, name, "averaging rule")


def _named(table: dict[str, int], name: str, what: str) -> int:
    try:
        return table[name]
    except (KeyError, TypeError):
        raise ConfigurationError(
            f"unknown {what} {name!r}; use one of {', '.join(table)}") from None


@dataclass(frozen=True)
class Geometry:
    """Which chunks one rank sends and receives in one collective (see the module docstring).

    ``sends`` and ``receives`` are input-layout chunk indices; :meth:`out_index` turns a
    received one into its index in :attr:`out_layout`, the rank's result buffer.
    """

    op: int
    layout: ChunkLayout
    out_layout: ChunkLayout
    sends: range
    receives: tuple[range, ...]
    #: Input index of output chunk 0 (reduce_scatter: the rank's segment start; else 0).
    out_base: int = 0
    #: With a wire format: the layouts in the tensor's own dtype (``layout`` and
    #: ``out_layout`` are then the encoded chunks' wire layouts); else None.
    values: ChunkLayout | None = None
    values_out: ChunkLayout | None = None

    def out_index(self, index: int) -> int:
        return index - self.out_base

    def in_index(self, out_index: int) -> int:
        return out_index + self.out_base

    @property
    def receive_count(self) -> int:
        return sum(len(r) for r in self.receives)


def input_layout(op: int, world_size: int, nbytes: int, chunk_bytes: int,
                 encoding: Encoding | None = None) -> ChunkLayout:
    """The layout every rank's chunk indices refer to; ``nbytes`` is one rank's input size
    (with ``encoding``, the wire layout of the encoded chunks)."""
    layout = _values_layout(op, world_size, nbytes, chunk_bytes)
    return layout if encoding is None else encoding.layout(layout)


def _values_layout(op: int, world_size: int, nbytes: int, chunk_bytes: int) -> ChunkLayout:
    if op == REDUCE_SCATTER:
        return ChunkLayout(world_size, nbytes // world_size, chunk_bytes)
    if op in (ALL_GATHER, ALL_TO_ALL):
        return ChunkLayout(world_size, nbytes, chunk_bytes)
    if op == BARRIER:
        return ChunkLayout(1, 0, chunk_bytes)
    return ChunkLayout(1, nbytes, chunk_bytes)


def geometry(op: int, world_size: int, rank: int, nbytes: int, chunk_bytes: int,
             root: int = 0, encoding: Encoding | None = None,
             encode_out: bool = True) -> Geometry:
    """Rank ``rank``'s part in a collective ``op`` over ``nbytes`` bytes of input per rank;
    with ``encoding`` (a wire format) its layouts are the wire layouts of the encoded chunks
    (the result's only if ``encode_out``: an averaging round answers float32 parameters) and
    :attr:`Geometry.values` / :attr:`Geometry.values_out` the layouts in the tensor's dtype.
    Chunk indices are the same either way."""
    g = _geometry(op, world_size, rank, nbytes, chunk_bytes, root)
    if encoding is None:
        return g
    out = encoding.layout(g.out_layout) if encode_out else g.out_layout
    return Geometry(op, encoding.layout(g.layout), out, g.sends, g.receives, g.out_base,
                    g.layout, g.out_layout)


def geometry_of(header: pb.CollectiveHeader, world_size: int) -> Geometry:
    """The geometry of the header's rank in the collective ``header`` describes (its wire
    format included; an averaging round's result is never encoded): what the hub and the rank
    both compute from the same header.

    Raises:
        ProtocolError: an unknown dtype or wire format.
    """
    return geometry(header.op, world_size, header.rank,
                    payload_bytes(header.shape, header.dtype), header.chunk_bytes, header.root,
                    Encoding.of_header(header), encode_out=not header.averaging.rule)


def _geometry(op: int, world_size: int, rank: int, nbytes: int, chunk_bytes: int,
              root: int) -> Geometry:
    layout = input_layout(op, world_size, nbytes, chunk_bytes)
    every = range(layout.count)
    none = range(0)
    per = layout.per_segment
    if op == ALL_REDUCE:
        return Geometry(op, layout, layout, every, (every,))
    if op == BROADCAST:
        if rank == root:
            return Geometry(op, layout, layout, every, ())
        return Geometry(op, layout, layout, none, (every,))
    if op in (ALL_GATHER, ALL_TO_ALL):
        own = range(rank * per, (rank + 1) * per)
        return Geometry(op, layout, layout, own,
                        (range(0, own.start), range(own.stop, layout.count)))
    if op == REDUCE_SCATTER:
        out = ChunkLayout(1, layout.segment_bytes, chunk_bytes)
        own = range(rank * per, (rank + 1) * per)
        return Geometry(op, layout, out, every, (own,), out_base=own.start)
    return Geometry(op, layout, layout, none, ())


def routes(op: int, layout: ChunkLayout, index: int, sender: int, world_size: int,
           root: int = 0) -> list[tuple[int, int]]:
    """Where the hub sends input chunk ``index``: ``(rank, output index)`` pairs.

    For reducing ops ``sender`` is ignored (the reduced chunk goes out once all have sent it);
    forwarded chunks go to every rank but the sender.
    """
    if op == ALL_REDUCE:
        return [(r, index) for r in range(world_size)]
    if op == REDUCE_SCATTER:
        owner = layout.segment_of(index)
        return [(owner, index - owner * layout.per_segment)]
    return [(r, index) for r in range(world_size) if r != sender]


def plan_length(world_size: int) -> int:
    """Elements (int64) of one rank's all_to_all plan: its form, dtype and elements per row,
    then the rows it sends to each rank and the rows it expects from each
    (``gradstar.client.all_to_all.Plan``)."""
    return 3 + 2 * world_size


def active_shards(layout: ChunkLayout, shards: int) -> int:
    """How many of ``shards`` hub shards carry a collective with this layout (at least one)."""
    return max(1, min(shards, layout.count))


def stripe_of(index: int, shards: int) -> int:
    """The shard that carries input chunk ``index`` when ``shards`` shards are active."""
    return index % shards


def in_stripe(indices, shard: int, shards: int) -> list[int]:
    """The input indices among ``indices`` (an iterable of ranges) that ``shard`` carries."""
    out: list[int] = []
    for r in indices:
        first = r.start + (shard - r.start) % shards
        out.extend(range(first, r.stop, shards))
    return out
