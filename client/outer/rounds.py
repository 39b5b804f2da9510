"""The replica's half of the Rounds service (:mod:`gradstar.coordinator.rounds`): seed, contribute
and fetch a fragment of a global model, each call under a deadline.

A replica is not a rank: it forms no generation and has no session, so another replica's death
never reaches it. Calls that find the coordinator unreachable are retried until the call's
deadline (a coordinator restarted with ``--state-dir`` is picked up again); the coordinator's
own verdicts are raised at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
import numpy as np

from gradstar.config import ClientSettings
from gradstar.errors import (
    CoordinatorUnavailableError,
    GradstarError,
    LeadershipError,
    ProtocolError,
    RoundTimeoutError,
)
from gradstar.proto.v1 import rounds_pb2 as pb
from gradstar.proto.v1 import rounds_pb2_grpc
from gradstar.transport.channels import PART_BYTES, call_metadata, open_channel
from gradstar.transport.status import error_from_rpc, is_coordinator_verdict
from gradstar.wire.chunks import header_first
from gradstar.wire.formats import WireFormat, encode

from ..collective.data_plane import resolve
from ..coordinators import Coordinators

log = logging.getLogger(__name__)

#: Longest one Fetch waits on the hub; the client asks again until its own deadline.
FETCH_POLL_SECONDS = 5.0
#: Pause before retrying a call that found the coordinator unreachable.
RETRY_PAUSE = 0.5


@dataclass(frozen=True)
class RoundPolicySpec:
    """What every replica of a round agrees on (see ``RoundPolicy`` in rounds.proto)."""

    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    min_replicas: int = 1
    round_timeout: float = 30.0

    def message(self) -> pb.RoundPolicy:
        return pb.RoundPolicy(outer_lr=self.outer_lr, outer_momentum=self.outer_momentum,
                              nesterov=self.nesterov, min_replicas=self.min_replicas,
                              round_timeout_seconds=self.round_timeout)


class RoundsClient:
    """Seed, Contribute and Fetch for one replica of one job (an asyncio object).

    Raises (from every method):
        RoundMismatchError: the hub's fragment disagrees (size, policy, round).
        RoundTimeoutError: the answer did not come before ``timeout`` seconds.
        AuthenticationError: the coordinator refused the token.
    """

    def __init__(self, settings: ClientSettings, replica: str) -> None:
        #: Where the coordinator may be (several under --ha: the replica follows the leader).
        self._coordinators = Coordinators(settings, bulk=True)
        self.settings = settings.model_copy(update={"coordinator": self._coordinators.current})
        self.job = settings.job
        self.replica = replica
        self._stub = rounds_pb2_grpc.RoundsStub(
            self._coordinators.channel(self._coordinators.current))
        self._bulk_channels: list[grpc.aio.Channel] = []
        # Contribute and Fetch go to the coordinator's collective port once a Seed reply names
        # it (connections there tolerate full links); back to this one if it goes away (a
        # restarted coordinator may have another).
        self._bulk_channel: grpc.aio.Channel | None = None
        self._data = self._stub
        self._metadata = call_metadata(settings)
        #: Payload bytes sent and received (for benchmarks and the demo's report).
        self.bytes_sent = 0
        self.bytes_received = 0

    def _key(self, model: str, fragment: int) -> pb.RoundsKey:
        return pb.RoundsKey(job=self.job, model=model, fragment=fragment, replica=self.replica)

    async def seed(self, model: str, fragment: int, params: np.ndarray, timeout: float) -> int:
        """Join, seeding the fragment with ``params`` if the hub has none; its round count."""
        header = pb.TensorHeader(key=self._key(model, fragment), numel=params.shape[0])
        reply = await self._retrying(lambda t: self._stub.Seed(
            _parts(header, params), timeout=t, metadata=self._metadata),
            f"seeding fragment {fragment} of {model!r}", timeout)
        self.bytes_sent += params.nbytes
        if reply.bulk_address and self._bulk_channel is None:
            target = resolve(reply.bulk_address, self.settings.coordinator)
            self._bulk_channel = open_channel(self.settings, target, bulk=True)
            self._bulk_channels.append(self._bulk_channel)
            self._data = rounds_pb2_grpc.RoundsStub(self._bulk_channel)
        return reply.rounds

    async def contribute(self, model: str, fragment: int, number: int, policy: RoundPolicySpec,
                         delta: np.ndarray, timeout: float,
                         wire: WireFormat | None = None) -> tuple[bool, int]:
        """Send the pseudo-gradient for round ``number``, encoded in ``wire`` if given (the hub
        decodes it to float32): (accepted, rounds completed)."""
        header = pb.TensorHeader(key=self._key(model, fragment), numel=delta.shape[0],
                                 round=number, policy=policy.message(),
                                 wire_format=wire.name if wire is not None else "")
        data = (encode(wire, np.ascontiguousarray(delta, dtype=np.float32)) if wire is not None
                else np.ascontiguousarray(delta, dtype="<f4").tobytes())
        reply = await self._retrying(lambda t: self._data.Contribute(
            _parts(header, data), timeout=t, metadata=self._metadata),
            f"round {number} of fragment {fragment} of {model!r}", timeout)
        self.bytes_sent += len(data)
        return reply.accepted, reply.rounds

    async def fetch(self, model: str, fragment: int, min_rounds: int,
                    timeout: float) -> tuple[int, np.ndarray]:
        """The fragment's global model once ``min_rounds`` rounds completed: (rounds, params).

        Raises:
            RoundTimeoutError: not within ``timeout`` seconds (too few replicas for a round).
            ProtocolError: the answer was malformed.
        """
        return await self._await_round(model, fragment, min_rounds, timeout,
                                       time.monotonic() + timeout, None)

    async def round(self, model: str, fragment: int, number: int, policy: RoundPolicySpec,
                    delta: np.ndarray, timeout: float,
                    wire: WireFormat | None = None) -> tuple[bool, int, np.ndarray]:
        """Contribute to round ``number`` and fetch the global fragment after it:
        (accepted, rounds, params). Not accepted: the round had closed without this replica,
        and the params are the current global fragment.

        The Fetch does not wait for the contribution's answer: it goes out beside it, so a
        round costs one round trip (the contribution's way in, the global fragment's way out)
        and not two. Either way it is answered with round ``number + 1``'s global fragment or
        a later one: after this replica's contribution closed the round, or, not accepted,
        the current one.

        A coordinator restarted meanwhile (with ``--state-dir``) keeps the completed rounds
        but not the open one: the contribution is sent again when the hub no longer holds it
        (only once the first one was answered: until then it may still be on its way).

        Raises: as :meth:`contribute` and :meth:`fetch`.
        """
        until = time.monotonic() + timeout
        answered = False

        async def resend() -> None:
            if answered:
                await self.contribute(model, fragment, number, policy, delta,
                                      max(until - time.monotonic(), 0.001), wire)

        fetch = asyncio.ensure_future(self._await_round(model, fragment, number + 1, timeout,
                                                        until, resend))
        try:
            accepted, _ = await self.contribute(model, fragment, number, policy, delta,
                                                timeout, wire)
            answered = True
            got, params = await fetch
        finally:
            if not fetch.done():
                fetch.cancel()  # the contribution failed: its error is the one to raise
                await asyncio.gather(fetch, return_exceptions=True)
        return accepted, got, params

    async def _await_round(self, model: str, fragment: int, min_rounds: int, timeout: float,
                           until: float, resend) -> tuple[int, np.ndarray]:
        """Poll Fetch until ``min_rounds`` completed (by ``until``, a monotonic time; the
        call's ``timeout`` is named in the error); ``resend()`` when the hub lost this
        replica's contribution to the open round."""
        what = f"fetching fragment {fragment} of {model!r} after round {min_rounds}"
        while True:
            left = until - time.monotonic()
            if left <= 0:
                raise RoundTimeoutError(
                    f"Timed out: {what}: the round did not close within {timeout:g} s "
                    "(fewer replicas than min_replicas contributed)")
            # The hub answers "not yet" after ``wait``: well inside the call's deadline, so
            # the answer (not the deadline) ends the poll.
            wait = min(FETCH_POLL_SECONDS, max(left - 1.0, left / 2))
            request = pb.FetchRequest(key=self._key(model, fragment), min_rounds=min_rounds,
                                      wait_seconds=wait)
            try:
                got = await self._retrying(lambda t, r=request: self._read_fetch(r, t), what,
                                           min(left, wait + 10.0))
            except RoundTimeoutError:
                if time.monotonic() < until:
                    raise  # the hub did not answer a poll within its own deadline
                continue  # our time is up: say so (above), not which poll it ended in
            if isinstance(got, tuple):
                return got
            if resend is not None and got is not None and not got.holds_contribution and (
                    got.rounds == min_rounds - 1):
                log.warning("the coordinator no longer holds this replica's contribution to "
                            "round %d of fragment %d of %r (it restarted); sending it again",
                            min_rounds - 1, fragment, model)
                await resend()

    async def _read_fetch(self, request: pb.FetchRequest, timeout: float):
        call = self._data.Fetch(request, timeout=timeout, metadata=self._metadata)
        parts = call.__aiter__()
        try:
            first = await anext(parts)
        except StopAsyncIteration:
            raise ProtocolError("a Fetch answer ended before its header") from None
        head = first.header
        if not head.ready:
            call.cancel()
            return head
        out = np.empty(head.numel, dtype="<f4")
        view = memoryview(out).cast("B")
        filled = 0
        async for part in parts:
            n = len(part.data)
            if filled + n > len(view):
                raise ProtocolError("a Fetch answer carried more data than it announced")
            view[filled:filled + n] = part.data
            filled += n
        if filled != len(view):
            raise ProtocolError(f"a Fetch answer announced {head.numel} values and carried "
                                f"{filled} bytes")
        self.bytes_received += filled
        return head.rounds, out.astype(np.float32, copy=False)

    async def _retrying(self, call, what: str, timeout: float):
        """``call(deadline)``, again while the coordinator is unreachable, for ``timeout`` s."""
        until = time.monotonic() + timeout
        while True:
            left = until - time.monotonic()
            address = self.settings.coordinator
            try:
                return await call(max(left, 0.001))
            except grpc.RpcError as rpc:
                if rpc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not (
                        is_coordinator_verdict(rpc)):
                    raise RoundTimeoutError(
                        f"Timed out: {what} got no answer from {self.settings.coordinator} "
                        f"within {timeout:g} s") from None
                error = error_from_rpc(rpc, what, self.settings.coordinator)
                gone = isinstance(error, CoordinatorUnavailableError | LeadershipError)
                if not gone or left <= RETRY_PAUSE:
                    raise error from None
                log.warning("%s; retrying", error)
                if address == self.settings.coordinator:  # not moved on by another call yet
                    self._follow(error)
            await asyncio.sleep(RETRY_PAUSE)

    def _follow(self, error: GradstarError) -> None:
        """The coordinator went away or does not lead: the calls go to its control port again
        (the collective port may be gone with it) and, with several coordinators (--ha), to
        the next one that may lead, or the leader it named."""
        self._data, self._bulk_channel = self._stub, None
        coordinators = self._coordinators
        if coordinators.several:
            address = coordinators.after(self.settings.coordinator,
                                         getattr(error, "leader", ""))
            self.settings = self.settings.model_copy(update={"coordinator": address})
            self._stub = self._data = rounds_pb2_grpc.RoundsStub(coordinators.channel(address))

    async def leave(self, timeout: float) -> None:
        """Leave the job's rounds for good: the hub's open and later rounds stop waiting for
        this replica."""
        key = pb.RoundsKey(job=self.job, replica=self.replica)
        await self._retrying(lambda t: self._stub.Leave(key, timeout=t, metadata=self._metadata),
                             "leaving the rounds", timeout)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._bulk_channels))
        await self._coordinators.close()


def _parts(header: pb.TensorHeader, values: np.ndarray | bytes):
    """The request stream: the header, then the data (raw float32, or the bytes a wire format
    encoded) in parts."""
    data = values if isinstance(values, bytes) else \
        np.ascontiguousarray(values, dtype="<f4").tobytes()
    return header_first(pb.TensorPart, header, data, PART_BYTES)
