"""gRPC servicer of the Rounds service: streams in, :class:`.table.RoundsTable` calls, streams
out, gradstar errors to statuses. Fetch waits (bounded) for a round to close. The replica's twin
is :mod:`gradstar.client.outer.rounds`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import grpc
import numpy as np

from gradstar.errors import ConfigurationError, ProtocolError
from gradstar.proto.v1 import rounds_pb2 as pb
from gradstar.proto.v1 import rounds_pb2_grpc
from gradstar.transport.auth import check_job_access
from gradstar.transport.channels import PART_BYTES
from gradstar.transport.status import error_status
from gradstar.wire.chunks import split_parts, take_part
from gradstar.wire.formats import FORMATS, WireFormat, decode_into, wire_format

from ..collective.deadlines import Changes, DeadlineTimer
from ..rendezvous.jobs import check_job_name
from .table import Policy, RoundsTable

log = logging.getLogger(__name__)

#: Longest a Fetch waits for a round before answering "not ready" (the client asks again, so
#: a dead hub or a lost answer is noticed within this, not after the whole round timeout).
MAX_FETCH_WAIT = 10.0


class RoundsServicer(rounds_pb2_grpc.RoundsServicer):
    """Seed, Contribute and Fetch over :class:`RoundsTable`; closes rounds at their deadlines."""

    def __init__(self, table: RoundsTable, max_chunk_bytes: int) -> None:
        self.table = table
        #: Named in Seed replies (``RoundStatus.bulk_address``): ":PORT" of the coordinator's
        #: collective server, which serves this servicer too; empty: none.
        self.bulk_address = ""
        self.max_chunk_bytes = max_chunk_bytes
        self._closed = Changes()
        table.on_closed = self._closed.wake  # every waiting Fetch rechecks its own fragment
        self._deadlines = DeadlineTimer(table, grace=0.01)
        #: Asked first by every call: raises NotLeaderError where the coordinator does not
        #: lead (``Coordinator.leads``, under --ha).
        self.leads: Callable[[], object] = lambda: 0

    async def Seed(self, request_iterator: AsyncIterator[pb.TensorPart],
                   context: grpc.aio.ServicerContext) -> pb.RoundStatus:
        async with error_status(context):
            self.leads()
            header, params = await self._read_tensor(request_iterator)
            k = header.key
            rounds = self.table.seed(k.job, k.model, k.fragment, k.replica, params)
            return pb.RoundStatus(rounds=rounds, accepted=True, numel=params.shape[0],
                                  bulk_address=self.bulk_address)

    async def Contribute(self, request_iterator: AsyncIterator[pb.TensorPart],
                         context: grpc.aio.ServicerContext) -> pb.RoundStatus:
        async with error_status(context):
            self.leads()
            header, delta = await self._read_tensor(request_iterator, contribution=True)
            k, p = header.key, header.policy
            policy = Policy(p.outer_lr, p.outer_momentum, p.nesterov, p.min_replicas,
                            p.round_timeout_seconds)
            if not np.isfinite(delta).all():
                raise ProtocolError(
                    f"replica {k.replica!r} sent a pseudo-gradient with NaN or infinite values "
                    f"for fragment {k.fragment} of {k.model!r}; it was not used")
            accepted, rounds = self.table.contribute(k.job, k.model, k.fragment, k.replica,
                                                     header.round, policy, delta)
            self._deadlines.arm()
            return pb.RoundStatus(rounds=rounds, accepted=accepted, numel=delta.shape[0])

    async def Fetch(self, request: pb.FetchRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[pb.FetchPart]:
        k = request.key
        async with error_status(context):
            self.leads()
            _check_key(k)
            self.table.replica(k.job, k.replica)
            # Read again after the wait even when it timed out: the round may have closed as
            # it ran out, and a stale "not ready, not held" would make the replica send again.
            await self._closed.wait(lambda: _fetchable(
                self.table.global_model(k.job, k.model, k.fragment), request.min_rounds),
                min(request.wait_seconds, MAX_FETCH_WAIT))
            held = self.table.global_model(k.job, k.model, k.fragment)
        if held is None:
            yield pb.FetchPart(header=pb.FetchHeader(ready=False))
            return
        ready = held.rounds >= request.min_rounds
        numel = held.params.shape[0]
        holds = not ready and self.table.holds(k.job, k.model, k.fragment, k.replica)
        yield pb.FetchPart(header=pb.FetchHeader(ready=ready, rounds=held.rounds, numel=numel,
                                                 holds_contribution=holds))
        if not ready:
            return
        # The model may be replaced while this streams: send the arrays of this version only.
        data = held.params.astype("<f4", copy=False).tobytes()
        for piece in split_parts(data, PART_BYTES):
            yield pb.FetchPart(data=piece)

    async def _read_tensor(self, request_iterator, contribution: bool = False,
                           ) -> tuple[pb.TensorHeader, np.ndarray]:
        """The header and the whole float32 vector of a Seed or Contribute stream (a
        ``contribution`` may come in a wire format: decoded here, the hub's model and outer
        optimizer stay float32).

        Raises:
            ProtocolError: no header, a part too large, or data of the wrong length.
            HubCapacityError: the vector is over the hub's size limit (refused before any
                memory is taken for it).
        """
        parts = request_iterator.__aiter__()
        try:
            first = await anext(parts)
        except StopAsyncIteration:
            raise ProtocolError("a rounds stream ended before its header") from None
        if not first.HasField("header"):
            raise ProtocolError("a rounds stream must begin with its header")
        header = first.header
        fmt = _wire(header, contribution)
        _check_key(header.key)
        self.table.check_numel(header.numel)
        out = np.empty(header.numel, dtype="<f4")
        # An encoded contribution is read whole, then decoded to float32 once.
        encoded = (bytearray(fmt.encoded_nbytes(header.numel)) if fmt is not None else None)
        view = memoryview(encoded if encoded is not None else out).cast("B")
        filled = take_part(first.data, view, 0, self.max_chunk_bytes, "a rounds")
        async for part in parts:
            if part.HasField("header"):
                raise ProtocolError("a rounds stream carries one header, at its start")
            filled = take_part(part.data, view, filled, self.max_chunk_bytes, "a rounds")
        if filled != len(view):
            raise ProtocolError(
                f"replica {header.key.replica!r} announced {header.numel} "
                f"{fmt.name if fmt else 'float32'} values but sent {filled} bytes; the stream "
                "was cut or malformed and nothing was used")
        if fmt is not None:
            decode_into(fmt, encoded, out)
        return header, out.astype(np.float32, copy=False)


    async def Leave(self, request: pb.RoundsKey,
                    context: grpc.aio.ServicerContext) -> pb.RoundStatus:
        async with error_status(context):
            self.leads()
            check_job_name(request.job)
            check_job_name(request.replica, "a replica name")
            check_job_access(request.job)
            self.table.leave(request.job, request.replica)
            self._deadlines.arm()
            return pb.RoundStatus()


def _fetchable(held, min_rounds: int) -> bool:
    """Whether a Fetch waiting for round ``min_rounds`` of ``held`` (None: not held) answers."""
    return held is None or held.rounds >= min_rounds


def _check_key(key: pb.RoundsKey) -> None:
    """Check a key before any state of its job is read or changed. Replicas form no
    generation: the call's token is what binds it to its job.

    Raises:
        ConfigurationError: an empty, overlong or unprintable job, model or replica.
        JobAccessError: the call's token is another job's own token.
    """
    check_job_name(key.job)
    check_job_name(key.model, "a model name")
    check_job_name(key.replica, "a replica name")
    check_job_access(key.job)


def _wire(header: pb.TensorHeader, contribution: bool) -> WireFormat | None:
    """The wire format a stream's data parts are in (None: raw float32).

    Raises:
        ProtocolError: an unknown format, or one on a Seed (the global model is seeded from
            exact parameters).
    """
    if not header.wire_format:
        return None
    if not contribution:
        raise ProtocolError("a Seed carries raw float32 parameters; wire formats are for "
                            "contributions (pseudo-gradients)")
    try:
        return wire_format(header.wire_format)
    except ConfigurationError:
        raise ProtocolError(f"this coordinator knows no wire format {header.wire_format!r} "
                            f"for rounds; known: {', '.join(sorted(FORMATS))}") from None
