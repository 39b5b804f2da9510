"""What a rank writes on a Collective stream for one collective: the header, its input chunks
(or, through a shared-memory segment, their announcements) and its end marker — as one message
when the collective is small (:func:`in_one_message`), else frame by frame. The stream that
carries them is :mod:`.stream`'s; what the frames are, :mod:`gradstar.wire`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.transport import shm
from gradstar.wire import (
    CHUNK_HEADER_BYTES,
    KIND_HEADER,
    MAX_BATCH_FRAMES,
    MAX_BATCHED_CHUNK_BYTES,
    encode_batch,
    encode_message,
    encode_shm_chunk,
    end_frame,
)

from .plan import CollectivePlan


async def frames(header: pb.CollectiveHeader, plan: CollectivePlan, sends: Sequence[int],
                  attached: asyncio.Future | None = None, segment: shm.Segment | None = None):
    """The rank's side of the stream: header, chunks ``sends`` of ``plan``, end marker. With
    a segment offered, the chunks wait for the target's answer (``attached``) and then go
    through the segment if it attached it."""
    layout, send = plan.geometry.layout, plan.send
    if attached is None or attached.done():
        # The stream path, or a segment the target attached before (eager): a small
        # collective can go at once, whole.
        whole = in_one_message(header, plan, sends, segment if attached is not None and
                                attached.result() else None)
        if whole is not None:
            yield whole
            return
    yield encode_message(KIND_HEADER, header)
    sent = 0
    if attached is not None and await attached:
        last = None  # the last announcement travels with the end marker, in one message
        for index in sends:
            if last is not None:
                yield last
            offset, length = layout.span(index)
            segment.data[offset:offset + length] = send[offset:offset + length]
            sent += length
            last = encode_shm_chunk(index)
        end = end_frame(len(sends), sent)
        yield end if last is None else encode_batch([last, end])
        return
    for frame in plan.chunk_frames(sends):
        sent += len(frame) - CHUNK_HEADER_BYTES
        yield frame
    yield end_frame(len(sends), sent)


def in_one_message(header: pb.CollectiveHeader, plan: CollectivePlan, sends: Sequence[int],
                    segment: shm.Segment | None) -> bytes | None:
    """The rank's whole side of a small collective as one message (a batch: header, chunks or
    their shared-memory announcements, end marker), or None when it is not small. Each gRPC
    message costs both ends more CPU than copying a few tens of KiB, and the hub, given the
    whole input at once, answers with accept, result and end marker in one message too.

    Small: through ``segment``, at most one chunk (with more, the hub reduces the first while
    the rank copies the next); on the stream, at most
    :data:`~gradstar.wire.MAX_BATCHED_CHUNK_BYTES` of chunk payload in all.
    """
    layout = plan.geometry.layout
    if len(sends) + 2 > MAX_BATCH_FRAMES:
        return None
    if segment is not None:
        if len(sends) > 1:
            return None
        frames, sent = [], 0
        for index in sends:
            offset, length = layout.span(index)
            segment.data[offset:offset + length] = plan.send[offset:offset + length]
            frames.append(encode_shm_chunk(index))
            sent += length
    else:
        sent = plan.geometry.send_bytes if sends is plan.geometry.sends else sum(
            layout.span(i)[1] for i in sends)
        if sent > MAX_BATCHED_CHUNK_BYTES:
            return None
        frames = list(plan.chunk_frames(sends))
    end = end_frame(len(sends), sent)
    return encode_batch([encode_message(KIND_HEADER, header), *frames, end])


__all__ = ["frames", "in_one_message"]
