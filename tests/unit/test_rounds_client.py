"""The replica's half of a round (:meth:`RoundsClient.round`) against an in-memory hub, no
sockets: the Fetch goes out beside the contribution (not after its answer), a poll that finds
the contribution not yet held does not send it twice, and a contribution's failure is raised
with its Fetch cancelled."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gradstar.client.outer.rounds import RoundPolicySpec, RoundsClient
from gradstar.config import ClientSettings
from gradstar.errors import RoundMismatchError
from gradstar.proto.v1 import rounds_pb2 as pb

NUMBER = 3  # the round contributed to
GLOBAL = np.arange(4, dtype=np.float32)


class FetchCall:
    """A Fetch answer stream: ``parts`` yielded once awaited, ``cancel()`` recorded."""

    def __init__(self, parts) -> None:
        self.parts, self.cancelled = parts, False

    def __aiter__(self):
        return self.parts.__aiter__()

    def cancel(self) -> None:
        self.cancelled = True


class Hub:
    """Contribute and Fetch in memory. A Contribute answers once a Fetch came (so a client
    that waits for that answer before it fetches never gets one: the round fails at the
    test's deadline); ``not_held_first``: the first Fetch answers at once, not ready and not
    holding the contribution (a poll that outran it)."""

    def __init__(self, *, not_held_first: bool = False, refuse: bool = False) -> None:
        self.fetched = asyncio.Event()
        self.contributed = asyncio.Event()
        self.contributions = 0
        self.fetches: list[FetchCall] = []
        self.not_held_first, self.refuse = not_held_first, refuse

    async def _contribute(self, parts: list) -> pb.RoundStatus:
        self.contributions += 1
        await asyncio.wait_for(self.fetched.wait(), 5.0)
        if self.refuse:
            raise RoundMismatchError("the round runs with another policy")
        self.contributed.set()
        return pb.RoundStatus(rounds=NUMBER, accepted=True, numel=GLOBAL.size)

    def Contribute(self, parts, timeout: float, metadata) -> object:  # gRPC's method names
        return self._contribute(list(parts))

    def Fetch(self, request: pb.FetchRequest, timeout: float, metadata) -> FetchCall:
        assert request.min_rounds == NUMBER + 1
        first = not self.fetches
        self.fetched.set()

        async def answer():
            if first and self.not_held_first:
                yield pb.FetchPart(header=pb.FetchHeader(ready=False, rounds=NUMBER,
                                                         holds_contribution=False))
                return
            await self.contributed.wait()
            yield pb.FetchPart(header=pb.FetchHeader(ready=True, rounds=NUMBER + 1,
                                                     numel=GLOBAL.size))
            yield pb.FetchPart(data=GLOBAL.tobytes())

        call = FetchCall(answer())
        self.fetches.append(call)
        return call


async def one_round(hub: Hub) -> tuple[bool, int, np.ndarray]:
    client = RoundsClient(ClientSettings(coordinator="127.0.0.1:9", job="j"), "r0")
    client._data = hub  # the in-memory hub stands for the collective port's stub
    try:
        return await client.round("global", 0, NUMBER, RoundPolicySpec(min_replicas=2),
                                  np.ones(GLOBAL.size, dtype=np.float32), 10.0)
    finally:
        await client.close()


def test_a_rounds_fetch_goes_out_before_its_contribution_is_answered():
    hub = Hub()
    accepted, rounds, params = asyncio.run(one_round(hub))
    assert (accepted, rounds) == (True, NUMBER + 1)
    np.testing.assert_array_equal(params, GLOBAL)
    assert hub.contributions == 1


def test_a_poll_that_outran_the_contribution_does_not_send_it_again():
    hub = Hub(not_held_first=True)
    accepted, rounds, params = asyncio.run(one_round(hub))
    assert (accepted, rounds) == (True, NUMBER + 1)
    np.testing.assert_array_equal(params, GLOBAL)
    assert len(hub.fetches) == 2
    assert hub.contributions == 1


def test_a_refused_contribution_is_raised_and_its_fetch_cancelled():
    hub = Hub(refuse=True)

    async def refused() -> set:
        with pytest.raises(RoundMismatchError, match="another policy"):
            await one_round(hub)
        return asyncio.all_tasks() - {asyncio.current_task()}

    assert asyncio.run(refused()) == set()  # the Fetch's poll is not left running
    assert hub.contributions == 1 and len(hub.fetches) == 1
