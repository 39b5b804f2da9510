"""One record per collective op (:class:`Op`), and the names of reduce ops and averaging rules:
what the hub (``gradstar.coordinator``) and the ranks (``gradstar.client``) both read, so the
two halves of the protocol cannot drift apart.

An op's record says everything that differs between ops: its wire enum and name, whether the
hub reduces it, its layout and exchange (:mod:`.geometry`), its preconditions (one sentence
each, raised with the caller's error class: :func:`check_preconditions`), whether its result
may overwrite its input in a shared-memory segment, and whether it takes a wire format.
Adding an op is a row here, an enum value in ``collective.proto`` and its methods on the
process groups (``docs/development.md``, "Adding a collective op").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gradstar.errors import ConfigurationError, GradstarError, InvalidCollectiveError
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import ChunkLayout
from gradstar.wire.encoded import Encoding

from .geometry import (
    Exchange,
    Geometry,
    Layout,
    encoded,
    exchange_geometry,
    exchange_routes,
    plan_length,
    values_layout,
)


@dataclass(frozen=True)
class Facts:
    """What a precondition reads: one rank's call as that rank made it."""

    shape: tuple[int, ...]
    dtype: str
    world_size: int
    root: int = 0
    rank: int = 0

    @property
    def plan(self) -> tuple[int]:
        """The shape of an all_to_all plan in this world (:func:`.geometry.plan_length`)."""
        return (plan_length(self.world_size),)


@dataclass(frozen=True)
class Precondition:
    """A condition a call must meet, and the sentence (formatted with the :class:`Facts`'
    fields and properties) that says it was not."""

    holds: Callable[[Facts], bool]
    sentence: str

    def check(self, facts: Facts, error: type[GradstarError]) -> None:
        if not self.holds(facts):
            fields = {name: getattr(facts, name) for name in
                      ("shape", "dtype", "world_size", "root", "rank", "plan")}
            raise error(self.sentence.format(**fields))


@dataclass(frozen=True)
class Op:
    """Everything that differs between collective ops."""

    name: str
    #: Its value in ``collective.proto``'s ``CollectiveOp``.
    wire: int
    #: Whether the hub reduces its chunks (else it forwards them unchanged).
    reduces: bool
    layout: Layout
    exchange: Exchange
    preconditions: tuple[Precondition, ...] = ()
    #: Whether its result may overwrite its input in a shared-memory segment: the hub writes
    #: result chunk i only after it read every rank's input chunk i.
    in_place: bool = False
    #: Whether it may travel in a compressed wire format (:func:`gradstar.ops.check_encoding`).
    takes_wire: bool = False
    #: Whether its ``root`` (``src``) means something.
    rooted: bool = False
    #: How an error message names a call whose header describes something other than the
    #: user's tensors (None: as the call, with its dtype and shape).
    shown_as: str | None = None


_ROOT_IN_RANGE = Precondition(lambda f: 0 <= f.root < f.world_size,
                              "broadcast src={root} is out of range for world_size {world_size}")
_DIM0_DIVISIBLE = Precondition(
    lambda f: len(f.shape) > 0 and f.shape[0] % f.world_size == 0,
    "reduce_scatter needs dim 0 divisible by world_size {world_size}, got shape {shape}")
_A_PLAN = Precondition(
    lambda f: f.dtype == "int64" and f.shape == f.plan,
    "rank {rank} sent an all_to_all plan of {dtype} shape {shape}; with world_size "
    "{world_size} a plan is int64 of shape {plan}")

#: wire enum -> record, for every collective op (tests/unit/test_ops_table.py: one per enum).
OPS: dict[int, Op] = {op.wire: op for op in (
    Op("all_reduce", pb.COLLECTIVE_OP_ALL_REDUCE, True, Layout.WHOLE, Exchange.REDUCED_TO_ALL,
       in_place=True, takes_wire=True),
    Op("broadcast", pb.COLLECTIVE_OP_BROADCAST, False, Layout.WHOLE, Exchange.FROM_ROOT,
       (_ROOT_IN_RANGE,), rooted=True),
    Op("all_gather", pb.COLLECTIVE_OP_ALL_GATHER, False, Layout.PER_RANK, Exchange.GATHERED),
    Op("reduce_scatter", pb.COLLECTIVE_OP_REDUCE_SCATTER, True, Layout.SPLIT,
       Exchange.SCATTERED, (_DIM0_DIVISIBLE,), takes_wire=True),
    Op("barrier", pb.COLLECTIVE_OP_BARRIER, False, Layout.EMPTY, Exchange.NONE),
    Op("all_to_all", pb.COLLECTIVE_OP_ALL_TO_ALL, False, Layout.PER_RANK, Exchange.GATHERED,
       (_A_PLAN,), shown_as="all_to_all (or all_to_all_single)"),
)}

ALL_REDUCE = pb.COLLECTIVE_OP_ALL_REDUCE
BROADCAST = pb.COLLECTIVE_OP_BROADCAST
ALL_GATHER = pb.COLLECTIVE_OP_ALL_GATHER
REDUCE_SCATTER = pb.COLLECTIVE_OP_REDUCE_SCATTER
BARRIER = pb.COLLECTIVE_OP_BARRIER
ALL_TO_ALL = pb.COLLECTIVE_OP_ALL_TO_ALL

#: wire enum -> name, for every collective op.
OP_NAMES = {wire: op.name for wire, op in OPS.items()}
#: Ops whose chunks the hub reduces (the others it forwards unchanged).
REDUCING = frozenset(wire for wire, op in OPS.items() if op.reduces)

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


def op_record(op: int) -> Op:
    """The record of wire value ``op``.

    Raises:
        InvalidCollectiveError: an unknown op.
    """
    try:
        return OPS[op]
    except KeyError:
        raise InvalidCollectiveError(f"unknown collective op {op}") from None


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


def check_preconditions(op: int, facts: Facts,
                        error: type[GradstarError] = InvalidCollectiveError) -> None:
    """Check ``facts`` against op ``op``'s preconditions, in the record's order.

    Raises:
        ``error`` (InvalidCollectiveError on the hub and, before anything is sent, on a rank):
            the first precondition that does not hold, in its sentence.
    """
    for precondition in OPS[op].preconditions:
        precondition.check(facts, error)


def input_layout(op: int, world_size: int, nbytes: int, chunk_bytes: int,
                 encoding: Encoding | None = None) -> ChunkLayout:
    """The layout every rank's chunk indices refer to; ``nbytes`` is one rank's input size
    (with ``encoding``, the wire layout of the encoded chunks)."""
    layout = values_layout(OPS[op].layout, world_size, nbytes, chunk_bytes)
    return layout if encoding is None else encoding.layout(layout)


def geometry(op: int, world_size: int, rank: int, nbytes: int, chunk_bytes: int,
             root: int = 0, encoding: Encoding | None = None,
             encode_out: bool = True) -> Geometry:
    """Rank ``rank``'s part in a collective ``op`` over ``nbytes`` bytes of input per rank;
    with ``encoding`` (a wire format) its layouts are the wire layouts of the encoded chunks
    (the result's only if ``encode_out``: an averaging round answers float32 parameters) and
    :attr:`Geometry.values` / :attr:`Geometry.values_out` the layouts in the tensor's dtype.
    Chunk indices are the same either way."""
    record = OPS[op]
    layout = values_layout(record.layout, world_size, nbytes, chunk_bytes)
    return encoded(exchange_geometry(record.exchange, op, layout, rank, root), encoding,
                   encode_out)


def routes(op: int, layout: ChunkLayout, index: int, sender: int, world_size: int,
           root: int = 0) -> list[tuple[int, int]]:
    """Where the hub sends input chunk ``index``: ``(rank, output index)`` pairs.

    For reducing ops ``sender`` is ignored (the reduced chunk goes out once all have sent it);
    forwarded chunks go to every rank but the sender.
    """
    return exchange_routes(OPS[op].exchange, layout, index, sender, world_size)


__all__ = ["ALL_GATHER", "ALL_REDUCE", "ALL_TO_ALL", "AVERAGING_RULES", "BARRIER", "BROADCAST",
           "OPS", "OP_NAMES", "REDUCE_OPS", "REDUCE_OP_NAMES", "REDUCE_SCATTER", "REDUCING",
           "RULE_NAMES", "Facts", "Op", "Precondition", "averaging_rule", "check_preconditions",
           "geometry", "input_layout", "op_name", "op_record", "reduce_op", "routes"]
