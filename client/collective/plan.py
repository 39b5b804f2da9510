"""The bookkeeping of a rank's Collective stream, without I/O: the rank's part in one collective
(:class:`CollectivePlan`, derived from the header as the hub derives it) and the incoming side
of one stream as a state machine (:class:`StreamReceiver`, its :class:`Phase` in one field):
``AWAITING_ACCEPT`` until the hub's accept, ``RECEIVING`` result chunks (each checked and
copied to its place, from the stream or from a shared-memory segment), ``COMPLETE`` once the
hub's end marker agreed with what arrived. The protocol, and the I/O that feeds frames in, is
:mod:`.stream`'s; tests drive this module frame by frame. Its twin on the hub is
:mod:`gradstar.coordinator.collective.engine` (the life of one collective, without sockets).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from gradstar import ops
from gradstar.errors import ProtocolError
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import (
    KIND_ACCEPT,
    KIND_CHUNK,
    KIND_END,
    KIND_ERROR,
    KIND_SHM_ATTACH,
    KIND_SHM_CHUNK,
    ChunkLayout,
    ChunkTracker,
    as_byte_view,
    decode_error,
    decode_message,
    decode_shared,
    decode_shm_chunk,
    frame_kind,
    frames_of,
    iter_chunk_frames,
    place_chunk,
    receive_chunk,
)
from gradstar.wire.encoded import Encoding


@dataclass(frozen=True)
class CollectivePlan:
    """One rank's part in one collective: what its header describes (``call``, derived once:
    :class:`gradstar.ops.CollectiveCall`) and the buffers it reads and fills.

    ``send`` is a byte view of the buffer cut by ``geometry.layout`` (the rank's input; for
    all_gather the result buffer holding the rank's own segment); ``out`` is the buffer the
    result chunks land in, cut by ``geometry.out_layout``, and ``result`` the caller's result
    array. Without a wire format the two are the same. With one, ``values`` is the rank's input
    (cut by ``geometry.values``, encoded chunk by chunk as it is sent,
    :meth:`Encoding.frames`), ``out`` the encoded result (cut by the wire layout
    ``geometry.out_layout``) and :meth:`finish` decodes it into ``result``.
    """

    call: ops.CollectiveCall
    send: memoryview
    out: np.ndarray
    result: np.ndarray
    values: np.ndarray | None = None

    @classmethod
    def for_call(cls, call: ops.CollectiveCall, send: np.ndarray | None,
                 result: np.ndarray) -> CollectivePlan:
        """The plan of ``call`` sending from ``send`` (None: nothing) into ``result``."""
        g = call.geometry
        if call.encoding is not None:
            # An averaging round's answer is float32 global parameters, not encoded.
            encoded_out = g.out_layout != g.values_out
            out = np.empty(g.out_layout.total_bytes, np.uint8) if encoded_out else result
            return cls(call, memoryview(b""), out, result, send)
        view = memoryview(b"") if send is None else as_byte_view(send)
        return cls(call, view, result, result)

    @classmethod
    def for_header(cls, header: pb.CollectiveHeader, world_size: int,
                   send: np.ndarray | None, out: np.ndarray) -> CollectivePlan:
        """The plan both sides derive from ``header`` (the hub derives the same call)."""
        return cls.for_call(ops.CollectiveCall.of(header, world_size), send, out)

    @property
    def geometry(self) -> ops.Geometry:
        return self.call.geometry

    @property
    def encoding(self) -> Encoding | None:
        return self.call.encoding

    def finish(self) -> np.ndarray:
        """The result, once every chunk arrived: with an encoded result, decoded into
        ``result`` only now (so a failure leaves it untouched)."""
        if self.out is not self.result:
            g = self.geometry
            received = [g.out_index(i) for r in g.receives for i in r]
            self.encoding.decode(self.out, g.values_out, received, self.result)
        return self.result

    def chunk_frames(self, sends: Iterable[int]):
        """The chunk frames of input chunks ``sends``, made as they are asked for."""
        if self.encoding is not None:
            return self.encoding.frames(self.values, self.geometry.values, sends)
        return iter_chunk_frames(self.send, self.geometry.layout, sends)

    def out_indices(self, indices: Iterable[int]) -> frozenset[int]:
        """The output indices (what travels from the hub) of received input ``indices``."""
        return frozenset(self.geometry.out_index(i) for i in indices)


class Phase(enum.Enum):
    """Where one stream's incoming side is."""

    #: The header is out; only ACCEPT (or ERROR) may come.
    AWAITING_ACCEPT = enum.auto()
    #: Matched: result chunks come, then END.
    RECEIVING = enum.auto()
    #: END arrived and agreed with what came: this stream's part of the result is valid.
    COMPLETE = enum.auto()


class StreamReceiver:
    """The incoming side of one Collective stream, frame by frame (no I/O).

    ``receives`` are the output indices this stream may carry; each arrives once, into
    ``out`` (a byte view of the result laid out by ``out_layout``).
    """

    def __init__(self, what: str, who: str, out_layout: ChunkLayout,
                 receives: frozenset[int], out: memoryview,
                 shm_out: memoryview | None = None) -> None:
        self.what = what
        self.phase = Phase.AWAITING_ACCEPT
        self.tracker = ChunkTracker(out_layout, who, allowed=receives)
        self.out = out
        #: The result region of the segment this stream offered (None: none offered), and
        #: the target's answer: None until it comes, then whether it attached the segment.
        self.shm_out = shm_out
        self.attached: bool | None = None if shm_out is not None else False
        self.refusal = ""
        #: The hub's END, once it came (it names the ranks the collective waited for).
        self.end: pb.CollectiveEnd | None = None

    def on_frame(self, frame: bytes) -> None:
        """Take one message from the hub: a frame, or a batch of them in order.

        Raises:
            GradstarError: the hub's verdict (an ERROR frame).
            ProtocolError: a frame out of place, or a bad chunk or end marker.
        """
        for one in frames_of(frame):
            self._on_frame(one)

    def _on_frame(self, frame: bytes) -> None:
        kind = frame_kind(frame)
        if kind == KIND_CHUNK and self.phase is Phase.RECEIVING:
            receive_chunk(frame, self.tracker, self.out)
        elif kind == KIND_SHM_CHUNK and self.phase is Phase.RECEIVING and self.attached:
            index = decode_shm_chunk(frame)
            offset, length = self.tracker.layout.span(index)
            place_chunk(index, self.shm_out[offset:offset + length], self.tracker, self.out)
        elif kind == KIND_SHM_ATTACH and self.attached is None:
            answer = decode_message(frame, KIND_SHM_ATTACH, pb.ShmAttach)
            self.attached, self.refusal = answer.attached, answer.reason
        elif kind == KIND_ACCEPT and self.phase is Phase.AWAITING_ACCEPT:
            accept = decode_shared(frame, KIND_ACCEPT, pb.CollectiveAccept)
            if accept.output_chunks != self.tracker.expected:
                raise ProtocolError(
                    f"{self.what}: the coordinator will send {accept.output_chunks} chunks, "
                    f"this rank expects {self.tracker.expected}"
                )
            self.phase = Phase.RECEIVING
        elif kind == KIND_ERROR:
            raise decode_error(frame)
        elif kind == KIND_END and self.phase is Phase.RECEIVING:
            self.end = decode_shared(frame, KIND_END, pb.CollectiveEnd)
            self.tracker.finish(self.end)
            self.phase = Phase.COMPLETE
        else:
            raise ProtocolError(f"{self.what}: unexpected frame of kind {kind}")


__all__ = ["CollectivePlan", "Phase", "StreamReceiver"]
