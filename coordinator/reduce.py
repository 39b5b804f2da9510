"""Elementwise reduction of chunks into pooled accumulators.

The hub reduces chunk ``i`` as soon as every rank has sent it (see :class:`Slot` for the
order of operations). Accumulators hold the accumulation dtype (float32 for half precision) and
come from a :class:`BufferPool`; they go back to it once their chunk is sent, so a steady
training loop reuses the same few buffers instead of faulting in fresh pages for every chunk.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from gradstar.errors import InvalidCollectiveError
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import DTypeInfo

_UFUNCS = {
    pb.REDUCE_OP_SUM: np.add,
    pb.REDUCE_OP_MEAN: np.add,
    pb.REDUCE_OP_MIN: np.minimum,
    pb.REDUCE_OP_MAX: np.maximum,
    pb.REDUCE_OP_PROD: np.multiply,
}


class BufferPool:
    """Free lists of 1-D arrays by (dtype, length), holding at most ``max_bytes`` idle."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self.idle_bytes = 0
        self._free: dict[tuple[np.dtype, int], list[np.ndarray]] = defaultdict(list)

    def take(self, dtype: np.dtype, length: int) -> np.ndarray:
        dtype = np.dtype(dtype)
        free = self._free.get((dtype, length))
        if free:
            buf = free.pop()
            self.idle_bytes -= buf.nbytes
            return buf
        return np.empty(length, dtype=dtype)

    def give(self, buf: np.ndarray) -> None:
        if self.idle_bytes + buf.nbytes > self.max_bytes:
            return
        self._free[(buf.dtype, buf.shape[0])].append(buf)
        self.idle_bytes += buf.nbytes


@dataclass(eq=False)
class Slot:
    """The contributions to one chunk so far.

    The first contribution is kept as a view of the received frame (no copy); the second is
    reduced with it into a pooled accumulator; the last one is reduced straight into the
    outgoing frame, so a 2-rank float32 all_reduce touches each chunk once on the hub.
    """

    count: int
    first: memoryview | None = None
    acc: np.ndarray | None = None


class ChunkReducer:
    """Reduces one collective's chunks with ``reduce_op`` over ``world_size`` contributions."""

    def __init__(self, reduce_op: int, dtype: DTypeInfo, world_size: int, pool: BufferPool):
        if reduce_op not in _UFUNCS:
            raise InvalidCollectiveError(f"unknown reduce op {reduce_op}")
        if reduce_op == pb.REDUCE_OP_MEAN and dtype.numpy.kind == "i":
            raise InvalidCollectiveError(
                f"op='mean' is not defined for {dtype.name} tensors; use op='sum' and divide, "
                "or cast to a floating dtype"
            )
        self.ufunc = _UFUNCS[reduce_op]
        self.mean = reduce_op == pb.REDUCE_OP_MEAN
        self.dtype = dtype
        self.acc_dtype = dtype.accumulate
        self.world_size = world_size
        self.pool = pool

    def _values(self, payload: memoryview) -> np.ndarray:
        return np.frombuffer(payload, dtype=self.dtype.numpy)

    def fold(self, slot: Slot | None, payload: memoryview) -> Slot:
        """Add a contribution that is not the last one; returns the chunk's updated slot."""
        if slot is None:
            return Slot(1, first=payload)
        values = self._values(payload)
        if slot.acc is None:
            slot.acc = self.pool.take(self.acc_dtype, values.shape[0])
            # dtype= makes half-precision inputs reduce in float32, not in their own precision.
            self.ufunc(self._values(slot.first), values, out=slot.acc, dtype=self.acc_dtype)
            slot.first = None
        else:
            self.ufunc(slot.acc, values, out=slot.acc, dtype=self.acc_dtype)
        slot.count += 1
        return slot

    def finish_into(self, slot: Slot | None, payload: memoryview, out: memoryview) -> None:
        """Add the last contribution and write the chunk's result, in the wire dtype, to ``out``."""
        values = self._values(payload)
        result = np.frombuffer(out, dtype=self.dtype.numpy)
        if slot is None:  # world_size 1
            np.copyto(result, values)
            return
        direct = self.acc_dtype == self.dtype.numpy
        if slot.acc is None and direct:
            self.ufunc(self._values(slot.first), values, out=result)
            if self.mean:
                np.divide(result, self.world_size, out=result)
            return
        acc = slot.acc if slot.acc is not None else self.pool.take(self.acc_dtype, values.shape[0])
        first = slot.acc if slot.acc is not None else self._values(slot.first)
        self.ufunc(first, values, out=acc, dtype=self.acc_dtype)
        if self.mean:
            np.divide(acc, self.world_size, out=acc)
        np.copyto(result, acc, casting="unsafe")
        self.release(slot, acc)

    def release(self, slot: Slot | None, acc: np.ndarray | None = None) -> None:
        """Return a slot's accumulator (or ``acc``) to the pool."""
        buf = acc if acc is not None else (slot.acc if slot is not None else None)
        if buf is not None:
            self.pool.give(buf)
        if slot is not None:
            slot.acc = slot.first = None
