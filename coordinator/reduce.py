"""Elementwise reduction of chunks into pooled accumulators.

The hub reduces chunk ``i`` as soon as every rank has sent it. The first arrival is copied
(and, for half precision, widened to float32) into an accumulator taken from a :class:`BufferPool`;
every later arrival is reduced into it in place. Accumulators go back to the pool once their
chunk is sent, so a steady training loop reuses the same few buffers instead of faulting in
fresh pages for every chunk.
"""

from __future__ import annotations

from collections import defaultdict

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
REDUCE_OP_NAMES = {
    pb.REDUCE_OP_SUM: "sum",
    pb.REDUCE_OP_MEAN: "mean",
    pb.REDUCE_OP_MIN: "min",
    pb.REDUCE_OP_MAX: "max",
    pb.REDUCE_OP_PROD: "prod",
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
        self.world_size = world_size
        self.pool = pool

    def start(self, payload: memoryview) -> np.ndarray:
        """A fresh accumulator holding the first contribution to a chunk."""
        values = np.frombuffer(payload, dtype=self.dtype.numpy)
        acc = self.pool.take(self.dtype.accumulate, values.shape[0])
        np.copyto(acc, values)
        return acc

    def add(self, acc: np.ndarray, payload: memoryview) -> None:
        """Fold another rank's contribution into ``acc`` in place."""
        self.ufunc(acc, np.frombuffer(payload, dtype=self.dtype.numpy), out=acc)

    def finish(self, acc: np.ndarray) -> np.ndarray:
        """The chunk's result in the wire dtype; ``acc`` may be returned to the pool after use."""
        if self.mean:
            np.divide(acc, self.world_size, out=acc)
        if acc.dtype == self.dtype.numpy:
            return acc
        # Narrowing to half precision: a temporary of half the accumulator's size.
        return acc.astype(self.dtype.numpy)

    def release(self, acc: np.ndarray) -> None:
        self.pool.give(acc)
