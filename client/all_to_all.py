"""all_to_all and all_to_all_single: the plan every rank checks, and the arithmetic of splits.

This module does no I/O; :class:`~gradstar.client.process_group.AsyncProcessGroup` drives the
protocol, in two phases:

1. **Plan.** Each rank describes its call as a :class:`Plan` (which form it called, its dtype,
   the elements per row, the rows it sends to each rank and the rows it expects from each) and
   sends it through the hub as collective ``all_to_all`` (:data:`gradstar.ops.ALL_TO_ALL`, the
   geometry of an all_gather of the plans). So the hub orders it among the other collectives
   and refuses a rank that called something else, as for any collective; and every rank gets
   every plan, runs the same :func:`check_plans` on them and reaches the same verdict: a
   :class:`~gradstar.errors.CollectiveMismatchError` naming the two ranks that disagree (rank
   ``i`` sends ``n`` rows to rank ``j``, which expects ``m`` from it), or nothing. Nothing of
   the payload moves before the plans agree, so a disagreement leaves nothing behind.
2. **Payload.** Rank ``i`` sends its segment ``j`` to rank ``j`` over its peer stream to ``j``
   (:mod:`gradstar.client.peer`) with the tag :func:`payload_tag` and receives segment ``i`` of
   every rank; receives are posted before sends. Each byte crosses the network once, from its
   sender to its receiver; the hub carries only the plans.

Why peer streams and not the hub for the payload (``benchmarks/all_to_all.py`` measures both
against gloo): through the hub, every byte crosses the network twice and all ``(N - 1) * S``
bytes of a call go through the hub's process and NIC, whose forwarding work grows with the
number of ranks; over peer streams each rank moves only its own ``S (N - 1) / N`` and the hub
handles a plan of ``8 * (3 + 2N)`` bytes per rank. The price is latency: a small all_to_all
costs a hub round trip (the plan) plus a peer round trip. (On one host, where the hub's shared
memory carries collective payloads, a route through the hub would be faster for large
tensors; the peer route serves the distributed case.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gradstar import ops
from gradstar.errors import CollectiveMismatchError, InvalidCollectiveError, ProtocolError
from gradstar.wire import dtype_from_wire

#: ``all_to_all_single``: one tensor, rows (dim 0) split by split sizes.
SINGLE = 1
#: ``all_to_all``: a list of tensors, one per rank, any shapes.
LIST = 2
FORM_NAMES = {SINGLE: "all_to_all_single", LIST: "all_to_all"}
#: In :attr:`Plan.expects`: this rank takes whatever the sender sends (``all_to_all``).
ANY = -1
_HEAD = ops.plan_length(0)  # form, dtype, elements per row; then sends and expects


def payload_tag(call: int) -> str:
    """The peer-stream tag of the payload of a rank's ``call``-th all_to_all. A user's tag is
    JSON (a number, a quoted string or a list), so this one never collides with it."""
    return f"all_to_all {call}"


@dataclass(frozen=True)
class Plan:
    """One rank's all_to_all call, as every rank checks it. ``sends[j]`` rows go to rank ``j``;
    ``expects[i]`` rows are expected from rank ``i`` (:data:`ANY`: whatever it sends). A row is
    ``row_elems`` elements of wire dtype ``dtype``; an ``all_to_all`` tensor is one row per
    element."""

    form: int
    dtype: int
    row_elems: int
    sends: tuple[int, ...]
    expects: tuple[int, ...]

    def encode(self) -> np.ndarray:
        return np.array([self.form, self.dtype, self.row_elems, *self.sends, *self.expects],
                        dtype=np.int64)

    @classmethod
    def decode(cls, row: np.ndarray, world_size: int) -> Plan:
        values = [int(v) for v in row]
        return cls(values[0], values[1], values[2], tuple(values[_HEAD:_HEAD + world_size]),
                   tuple(values[_HEAD + world_size:]))

    @property
    def name(self) -> str:
        return FORM_NAMES.get(self.form, f"all_to_all form {self.form}")


def split_sizes(sizes, rows: int | None, world_size: int, what: str) -> list[int]:
    """The split sizes along dim 0 of a tensor of ``rows`` rows: ``sizes`` checked, or equal
    splits when ``sizes`` is None or empty (as in torch.distributed). ``rows`` None: the tensor
    is made to fit the sizes (no sum to check; equal splits then need ``rows``).

    Raises:
        InvalidCollectiveError: not ``world_size`` non-negative ints, a sum other than
            ``rows``, or (equal splits) ``rows`` not divisible by ``world_size``.
    """
    if sizes is None or len(sizes) == 0:
        if rows is None:
            raise InvalidCollectiveError(f"{what} is needed: the tensor's rows are not known")
        if rows % world_size:
            raise InvalidCollectiveError(
                f"{what} is None, so dim 0 ({rows}) must be divisible by world_size "
                f"{world_size}")
        return [rows // world_size] * world_size
    sizes = list(sizes)
    if len(sizes) != world_size:
        raise InvalidCollectiveError(
            f"{what} has {len(sizes)} entries; it needs one per rank ({world_size})")
    if not all(isinstance(s, int | np.integer) and not isinstance(s, bool) and s >= 0
               for s in sizes):
        raise InvalidCollectiveError(f"{what} must be non-negative ints, got {sizes}")
    sizes = [int(s) for s in sizes]
    if rows is not None and sum(sizes) != rows:
        raise InvalidCollectiveError(
            f"{what} {sizes} sums to {sum(sizes)}, but dim 0 of the tensor is {rows}")
    return sizes


def row_elements(shape: Sequence[int]) -> int:
    """Elements per row (dim 0) of a tensor of ``shape``."""
    return math.prod(shape[1:])


def offsets(sizes: Sequence[int]) -> list[int]:
    """Where each split starts: the running sum of ``sizes`` (one more entry: the total)."""
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return out


def check_plans(plans: Sequence[Plan], seq: str) -> None:
    """Check every rank's plan against every other; ``seq`` names the call in messages. Every
    rank runs this on the same plans, so every rank raises the same error, or none does.

    Raises:
        CollectiveMismatchError: ranks called different forms, or disagree on the dtype, on the
            row size, or on the rows one sends another (naming both ranks and both sizes).
    """
    first = plans[0]
    for rank, plan in enumerate(plans):
        if plan.form != first.form:
            _mismatch(seq, rank, "op", f"rank {rank} called {plan.name} but rank 0 called "
                                       f"{first.name}")
        if plan.dtype != first.dtype:
            _mismatch(seq, rank, "dtype", f"rank {rank} passes {_dtype(plan.dtype)} but rank 0 "
                                          f"passes {_dtype(first.dtype)}")
        if plan.row_elems != first.row_elems:
            _mismatch(seq, rank, "shape",
                      f"rank {rank}'s rows (dim 0) have {plan.row_elems} elements but rank 0's "
                      f"have {first.row_elems}")
    for src, plan in enumerate(plans):
        for dst, rows in enumerate(plan.sends):
            expected = plans[dst].expects[src]
            if expected not in (ANY, rows):
                _mismatch(seq, dst, "split sizes",
                          f"rank {src} sends {rows} rows to rank {dst} (its "
                          f"input_split_sizes[{dst}] = {rows}) but rank {dst} expects "
                          f"{expected} from rank {src} (its output_split_sizes[{src}] = "
                          f"{expected})")


def _dtype(wire: int) -> str:
    try:
        return dtype_from_wire(wire).name
    except ProtocolError:  # a plan from a rank of another version: name the number
        return f"dtype {wire}"


def _mismatch(seq: str, rank: int, field: str, detail: str) -> None:
    verb = "differ" if field.endswith("s") else "differs"
    raise CollectiveMismatchError(
        f"ranks disagree on {seq}: {detail} ({field} {verb}); every rank must pass matching "
        "arguments", rank=rank, field=field)


__all__ = ["ANY", "FORM_NAMES", "LIST", "SINGLE", "Plan", "check_plans", "offsets",
           "payload_tag", "row_elements", "split_sizes"]
