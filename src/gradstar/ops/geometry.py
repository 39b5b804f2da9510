"""Which chunks every rank sends and receives: the layouts and exchanges an op's record
(:mod:`.table`) names, read by the hub and the ranks alike.

Geometry. A collective's tensor is cut by a :class:`~gradstar.wire.ChunkLayout` (the *input
layout*, :class:`Layout`); a chunk index always refers to it. Each op names one of these
(:class:`Exchange`):

================ ============================ ===================== ===========================
exchange         ops                          rank r sends          rank r receives
================ ============================ ===================== ===========================
REDUCED_TO_ALL   all_reduce                   every chunk           every chunk, reduced
FROM_ROOT        broadcast                    every chunk if root   every chunk unless root
GATHERED         all_gather, all_to_all       segment r             every segment but r
SCATTERED        reduce_scatter               every chunk           segment r, reduced
NONE             barrier                      nothing               nothing
================ ============================ ===================== ===========================

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

import enum
import functools
import itertools
from dataclasses import dataclass

from gradstar.wire import ChunkLayout
from gradstar.wire.encoded import Encoding


class Layout(enum.Enum):
    """How one rank's input of ``nbytes`` bytes is cut into segments."""

    #: One segment: the whole tensor.
    WHOLE = enum.auto()
    #: ``world_size`` segments of ``nbytes`` each (a segment per rank: all_gather's result).
    PER_RANK = enum.auto()
    #: ``world_size`` segments splitting ``nbytes`` (dim 0 split: reduce_scatter's input).
    SPLIT = enum.auto()
    #: No bytes at all.
    EMPTY = enum.auto()


class Exchange(enum.Enum):
    """Which chunks each rank sends and receives (see the module docstring's table)."""

    REDUCED_TO_ALL = enum.auto()
    FROM_ROOT = enum.auto()
    GATHERED = enum.auto()
    SCATTERED = enum.auto()
    NONE = enum.auto()


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

    @functools.cached_property
    def send_bytes(self) -> int:
        """Payload bytes of the chunks the rank sends (of the layout's chunks: encoded ones
        with a wire format), derived once: a small collective's lane asks on every call."""
        return sum(self.layout.span(i)[1] for i in self.sends)


def values_layout(layout: Layout, world_size: int, nbytes: int,
                  chunk_bytes: int) -> ChunkLayout:
    """The input layout, in the tensor's own dtype, of one rank's ``nbytes`` bytes."""
    if layout is Layout.SPLIT:
        return ChunkLayout(world_size, nbytes // world_size, chunk_bytes)
    if layout is Layout.PER_RANK:
        return ChunkLayout(world_size, nbytes, chunk_bytes)
    if layout is Layout.EMPTY:
        return ChunkLayout(1, 0, chunk_bytes)
    return ChunkLayout(1, nbytes, chunk_bytes)


def exchange_geometry(exchange: Exchange, op: int, layout: ChunkLayout, rank: int,
                      root: int) -> Geometry:
    """Rank ``rank``'s part in an ``exchange`` over input ``layout``."""
    every = range(layout.count)
    none = range(0)
    per = layout.per_segment
    if exchange is Exchange.REDUCED_TO_ALL:
        return Geometry(op, layout, layout, every, (every,))
    if exchange is Exchange.FROM_ROOT:
        if rank == root:
            return Geometry(op, layout, layout, every, ())
        return Geometry(op, layout, layout, none, (every,))
    if exchange is Exchange.GATHERED:
        own = range(rank * per, (rank + 1) * per)
        return Geometry(op, layout, layout, own,
                        (range(0, own.start), range(own.stop, layout.count)))
    if exchange is Exchange.SCATTERED:
        out = ChunkLayout(1, layout.segment_bytes, layout.chunk_bytes)
        own = range(rank * per, (rank + 1) * per)
        return Geometry(op, layout, out, every, (own,), out_base=own.start)
    return Geometry(op, layout, layout, none, ())


def encoded(g: Geometry, encoding: Encoding | None, encode_out: bool = True) -> Geometry:
    """``g`` with its layouts those of ``encoding``'s encoded chunks (the result's only if
    ``encode_out``); :attr:`Geometry.values` / :attr:`Geometry.values_out` then keep the
    layouts in the tensor's dtype. Unchanged without an encoding."""
    if encoding is None:
        return g
    out = encoding.layout(g.out_layout) if encode_out else g.out_layout
    return Geometry(g.op, encoding.layout(g.layout), out, g.sends, g.receives, g.out_base,
                    g.layout, g.out_layout)


def exchange_routes(exchange: Exchange, layout: ChunkLayout, index: int, sender: int,
                    world_size: int) -> list[tuple[int, int]]:
    """Where the hub sends input chunk ``index`` of an ``exchange``: ``(rank, output index)``
    pairs (see :func:`gradstar.ops.routes`)."""
    if exchange is Exchange.REDUCED_TO_ALL:
        return [(r, index) for r in range(world_size)]
    if exchange is Exchange.SCATTERED:
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
    return list(itertools.chain.from_iterable(stripe_indices(indices, shard, shards).ranges))


class Indices:
    """Chunk indices held as ranges: membership and a count in constant memory, where a set of
    a stripe of 2^20 chunks would take tens of MiB of the hub per header."""

    __slots__ = ("_count", "ranges")

    def __init__(self, ranges) -> None:
        self.ranges = tuple(ranges)
        self._count = sum(len(r) for r in self.ranges)

    def __contains__(self, index: object) -> bool:
        return any(index in r for r in self.ranges)

    def __len__(self) -> int:
        return self._count

    def __iter__(self):
        return itertools.chain.from_iterable(self.ranges)


def stripe_indices(indices, shard: int, shards: int) -> Indices:
    """:func:`in_stripe` as :class:`Indices`, without a list of them."""
    return Indices(range(r.start + (shard - r.start) % shards, r.stop, shards) for r in indices)


__all__ = ["Exchange", "Geometry", "Indices", "Layout", "active_shards", "encoded",
           "exchange_geometry", "exchange_routes", "in_stripe", "plan_length", "stripe_indices",
           "stripe_of", "values_layout"]
