"""The failure table and the ending both collective roads share
(gradstar.client.collective.failure), without sockets: which error each failure is raised as,
when the session is asked, when the hub is told a rank gave up, and when a stream goes back."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gradstar.client.collective.caller_stream import StreamStatus
from gradstar.client.collective.failure import StreamEnding, classify
from gradstar.client.collective.plan import Phase
from gradstar.errors import (
    ERROR_NAME_KEY,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CoordinatorUnavailableError,
    ProtocolError,
    RankLostError,
)

WHAT, WHERE = "collective seq 7", "127.0.0.1:5"


def test_the_table_names_each_failure_and_says_when_the_session_is_asked():
    deadline = classify(TimeoutError(), WHAT, WHERE)
    assert isinstance(deadline.error, CollectiveTimeoutError) and deadline.ask_session
    assert str(deadline.error) == (
        f"Timed out: {WHAT} got no answer from {WHERE} before its deadline")
    broke = classify(StreamStatus(grpc.StatusCode.UNAVAILABLE, "gone", ()), WHAT, WHERE)
    assert isinstance(broke.error, CoordinatorUnavailableError) and broke.ask_session
    assert WHERE in str(broke.error)
    hub = StreamStatus(grpc.StatusCode.FAILED_PRECONDITION, "shapes differ",
                       ((ERROR_NAME_KEY, "CollectiveMismatchError"),))
    verdict = classify(hub, WHAT, WHERE)
    assert isinstance(verdict.error, CollectiveMismatchError) and not verdict.ask_session
    assert hub.__traceback__ is None  # it would hold the call
    # Raised as they are: the hub's verdict from a frame, a bad frame, a gradstar timeout.
    for error in (CollectiveMismatchError("x"), ProtocolError("x"), CollectiveTimeoutError("x"),
                  asyncio.CancelledError(), KeyboardInterrupt()):
        assert classify(error, WHAT, WHERE) is None


class Receiver:
    def __init__(self, phase: Phase) -> None:
        self.phase = phase


def ending(phase: Phase, verdict, **kwargs):
    """A StreamEnding over a receiver in ``phase``, and what it did: ``ends`` (the clean flag
    of each end_stream) and ``abandoned`` (how often it told the hub)."""
    did = {"ends": [], "abandoned": 0}

    def abandon():
        did["abandoned"] += 1

    return StreamEnding(WHAT, WHERE, Receiver(phase), end_stream=did["ends"].append,
                        abandon=abandon, verdict=verdict, **kwargs), did


def raise_in(block, error):
    with block:
        raise error


async def raise_in_async(block, error):
    async with block:
        raise error


def test_a_completed_stream_goes_back_and_any_other_is_closed():
    block, did = ending(Phase.COMPLETE, lambda: None)
    with block:
        pass
    assert did == {"ends": [True], "abandoned": 0}
    block, did = ending(Phase.RECEIVING, lambda: None)
    with pytest.raises(ProtocolError):
        raise_in(block, ProtocolError("no end marker"))
    assert did == {"ends": [False], "abandoned": 0}


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, asyncio.CancelledError])
def test_an_interruption_before_the_accept_tells_the_hub_and_is_raised_as_it_is(interruption):
    block, did = ending(Phase.AWAITING_ACCEPT, lambda: pytest.fail("the session was asked"))
    with pytest.raises(interruption):
        raise_in(block, interruption())
    assert did == {"ends": [False], "abandoned": 1}
    block, did = ending(Phase.RECEIVING, lambda: None)  # the hub holds the header already
    with pytest.raises(interruption):
        raise_in(block, interruption())
    assert did["abandoned"] == 0
    block, did = ending(Phase.AWAITING_ACCEPT, lambda: None)  # the hub's own verdict
    with pytest.raises(CollectiveMismatchError):
        raise_in(block, CollectiveMismatchError("shapes differ"))
    assert did["abandoned"] == 0


def test_a_broken_stream_asks_the_session_on_both_roads():
    lost = RankLostError("rank 1 was lost", rank=1)
    broke = StreamStatus(grpc.StatusCode.UNAVAILABLE, "gone", ())

    async def lost_async():
        return lost

    async def none_async():
        return None

    block, _ = ending(Phase.RECEIVING, lambda: lost)
    with pytest.raises(RankLostError):
        raise_in(block, broke)
    block, _ = ending(Phase.RECEIVING, lost_async)
    with pytest.raises(RankLostError):
        asyncio.run(raise_in_async(block, broke))
    # The session knows nothing: the gRPC status's error, on both roads.
    block, _ = ending(Phase.RECEIVING, lambda: None)
    with pytest.raises(CoordinatorUnavailableError):
        raise_in(block, broke)
    block, _ = ending(Phase.RECEIVING, none_async)
    with pytest.raises(CollectiveTimeoutError, match="Timed out"):
        asyncio.run(raise_in_async(block, TimeoutError()))


def test_the_reason_a_stream_was_ended_from_outside_stands_for_what_its_read_raised():
    cancelled = StreamStatus(grpc.StatusCode.CANCELLED, "ended", ())
    lost = RankLostError("rank 1 was lost", rank=1)
    block, _ = ending(Phase.RECEIVING, lambda: None, ended_by=lambda: lost)
    with pytest.raises(RankLostError) as raised:
        raise_in(block, cancelled)
    assert raised.value is lost
    # A deadline the watch saw pass: the table's timeout, after asking the session.
    asked = []
    block, _ = ending(Phase.RECEIVING, lambda: asked.append(1), ended_by=TimeoutError)
    with pytest.raises(CollectiveTimeoutError, match=f"no answer from {WHERE}"):
        raise_in(block, cancelled)
    assert asked == [1]
