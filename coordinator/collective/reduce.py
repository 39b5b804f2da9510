"""Elementwise reduction of chunks into pooled accumulators.

The hub reduces chunk ``i`` as soon as every rank has sent it (see :class:`Slot` for the
order of operations). Accumulators hold the accumulation dtype (float32 for half precision) and
come from a :class:`BufferPool`; they go back to it once their chunk is sent, so a steady
training loop reuses the same few buffers instead of faulting in fresh pages for every chunk.

A collective in a wire format (:mod:`gradstar.wire.formats`) is reduced by
:class:`EncodedChunkReducer`: every contribution is decoded into a float32 accumulator, and the
result is encoded once, into the frame every rank gets, so it is rounded once on its way out
whatever the number of ranks.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from gradstar import ops
from gradstar.errors import InvalidCollectiveError
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import ChunkLayout, DTypeInfo
from gradstar.wire.encoded import Encoding
from gradstar.wire.formats import decode_into, encode_into

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

    def fold(self, slot: Slot | None, payload: memoryview, index: int = 0) -> Slot:
        """Add a contribution to chunk ``index`` that is not the last one; returns the chunk's
        updated slot (``index`` matters to :class:`EncodedChunkReducer` only)."""
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

    def finish_into(self, slot: Slot | None, payload: memoryview, out: memoryview,
                    index: int = 0) -> None:
        """Add the last contribution to chunk ``index`` and write its result, in the wire dtype,
        to ``out``."""
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


class EncodedChunkReducer:
    """Reduces one collective's chunks that travel in a wire format: decoded into float32,
    reduced in float32, the result encoded once (``op='mean'`` divided before encoding).

    ``values`` is the collective's layout in its own dtype: it says how many elements each
    encoded chunk holds. Unless ``encode_result``, the result is written as float32 (an
    averaging round: the hub turns it into float32 global parameters). Same interface as
    :class:`ChunkReducer`.
    """

    def __init__(self, reduce_op: int, encoding: Encoding, values: ChunkLayout,
                 world_size: int, pool: BufferPool, encode_result: bool = True):
        if reduce_op not in _UFUNCS:
            raise InvalidCollectiveError(f"unknown reduce op {reduce_op}")
        self.ufunc = _UFUNCS[reduce_op]
        self.mean = reduce_op == pb.REDUCE_OP_MEAN
        self.encoding = encoding
        self.values = values
        self.world_size = world_size
        self.pool = pool
        self.encode_result = encode_result

    def _decode(self, payload: memoryview, n: int, slot: Slot | None) -> Slot:
        # Inf and NaN are values the wire carries (and a rank may send any scale): numpy's
        # overflow and invalid-value warnings about them would only fill the hub's log.
        with np.errstate(all="ignore"):
            return self._decode_into_slot(payload, n, slot)

    def _decode_into_slot(self, payload: memoryview, n: int, slot: Slot | None) -> Slot:
        fmt = self.encoding.format
        if slot is None:
            acc = self.pool.take(np.float32, n)
            decode_into(fmt, payload, acc)
            return Slot(1, acc=acc)
        scratch = self.pool.take(np.float32, n)
        try:
            if self.ufunc is np.add:
                decode_into(fmt, payload, slot.acc, accumulate=True, scratch=scratch)
            else:
                decode_into(fmt, payload, scratch)
                self.ufunc(slot.acc, scratch, out=slot.acc)
        finally:
            self.pool.give(scratch)
        slot.count += 1
        return slot

    def fold(self, slot: Slot | None, payload: memoryview, index: int) -> Slot:
        """Decode and add a contribution to chunk ``index`` that is not the last one."""
        return self._decode(payload, self.encoding.elements(self.values, index)[1], slot)

    def finish_into(self, slot: Slot | None, payload: memoryview, out: memoryview,
                    index: int) -> None:
        """Decode and add the last contribution to chunk ``index``; encode the result into
        ``out`` (the encoded size of the chunk; float32 unless ``encode_result``)."""
        if slot is None and self.encode_result:  # world_size 1: the contribution as it came
            out[:] = payload
            return
        slot = self._decode(payload, self.encoding.elements(self.values, index)[1], slot)
        with np.errstate(all="ignore"):  # as in _decode
            if self.mean:
                np.divide(slot.acc, self.world_size, out=slot.acc)
            if self.encode_result:
                encode_into(self.encoding.format, slot.acc, out)
            else:
                np.copyto(np.frombuffer(out, dtype=np.float32), slot.acc)
        self.release(slot)

    def release(self, slot: Slot | None, acc: np.ndarray | None = None) -> None:
        """Return a slot's accumulator to the pool."""
        if slot is not None and slot.acc is not None:
            self.pool.give(slot.acc)
            slot.acc = None


def reducer_for(call: ops.CollectiveCall,
                pool: BufferPool) -> ChunkReducer | EncodedChunkReducer | None:
    """The reducer of ``call`` (None: its op forwards), in its wire format if any."""
    if not call.op.reduces:
        return None
    h = call.header
    if call.encoding is None:
        return ChunkReducer(h.reduce_op, call.dtype, call.world_size, pool)
    return EncodedChunkReducer(h.reduce_op, call.encoding, call.geometry.values,
                               call.world_size, pool, encode_result=not h.averaging.rule)
