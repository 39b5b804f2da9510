"""The peer mailbox without sockets: tag matching, bounded early buffering, closing."""

from __future__ import annotations

import asyncio

import pytest

from gradstar.client.peer.mailbox import MAX_TAG_CHARS, Mailbox, tag_key
from gradstar.errors import ConfigurationError


class Lost(Exception):
    pass


async def deliver(box: Mailbox, tag: str, value, nbytes: int = 1) -> None:
    box.put(await box.admit(tag, nbytes), value)


def test_tag_keys_are_canonical_json():
    assert tag_key(3) == "3"
    assert tag_key("act") == '"act"'
    assert tag_key((1, 2, "grad")) == tag_key([1, 2, "grad"]) == '[1, 2, "grad"]'
    assert len({tag_key(t) for t in (1, "1", (1,), ("1",))}) == 4


@pytest.mark.parametrize("tag", [1.0, None, True, (1, None), ((1,),), {"a": 1}, "x" * 600])
def test_other_tags_are_configuration_errors(tag):
    with pytest.raises(ConfigurationError, match="tag"):
        tag_key(tag)


def test_a_tag_key_is_at_most_max_tag_chars_long():
    assert len(tag_key("x" * (MAX_TAG_CHARS - 2))) == MAX_TAG_CHARS  # the quotes count
    with pytest.raises(ConfigurationError, match=f"longer than {MAX_TAG_CHARS} characters"):
        tag_key("x" * (MAX_TAG_CHARS - 1))
    with pytest.raises(ConfigurationError, match="longer than"):
        tag_key(tuple(range(200)))


async def test_messages_match_by_tag_and_keep_send_order_within_a_tag():
    box = Mailbox(0, max_messages=10, max_bytes=100)
    for tag, value in [("a", 1), ("b", 2), ("a", 3)]:
        await deliver(box, tag, value)
    assert await box.take("b") == 2
    assert [await box.take("a"), await box.take("a")] == [1, 3]
    assert box.buffered_messages == box.buffered_bytes == 0


async def test_a_waiting_receiver_gets_the_message_without_buffering_it():
    box = Mailbox(0, max_messages=1, max_bytes=0)
    taker = asyncio.ensure_future(box.take("x"))
    await asyncio.sleep(0)
    reservation = await asyncio.wait_for(box.admit("x", 1000), 1)
    assert not reservation.buffered
    box.put(reservation, "payload")
    assert await taker == "payload"
    assert box.peak_buffered_bytes == 0


async def test_admission_waits_when_the_buffer_is_full_until_room_is_made():
    box = Mailbox(0, max_messages=2, max_bytes=100)
    await deliver(box, "a", 1, 40)
    await deliver(box, "b", 2, 40)
    waiting = asyncio.ensure_future(box.admit("c", 40))  # a third message: over the count
    await asyncio.sleep(0.01)
    assert not waiting.done() and box.stalled_on == "c"
    assert await box.take("a") == 1
    reservation = await asyncio.wait_for(waiting, 1)
    assert reservation.buffered and box.stalled_on is None
    assert (box.buffered_messages, box.buffered_bytes, box.peak_buffered_bytes) == (2, 80, 80)


async def test_admission_waits_for_byte_room_too():
    box = Mailbox(0, max_messages=10, max_bytes=100)
    await deliver(box, "a", 1, 70)
    waiting = asyncio.ensure_future(box.admit("b", 40))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    await box.take("a")
    assert (await asyncio.wait_for(waiting, 1)).buffered


async def test_a_stalled_message_goes_through_once_its_receiver_asks():
    box = Mailbox(0, max_messages=1, max_bytes=10)
    await deliver(box, "held", 1)
    stalled = asyncio.ensure_future(box.admit("big", 1_000))
    await asyncio.sleep(0.01)
    assert not stalled.done()
    taker = asyncio.ensure_future(box.take("big"))
    reservation = await asyncio.wait_for(stalled, 1)
    assert not reservation.buffered
    box.put(reservation, "big one")
    assert await taker == "big one"
    assert box.held_tags() == ["held"]


async def test_closing_fails_waiting_receivers_but_keeps_held_messages():
    box = Mailbox(0, max_messages=4, max_bytes=100)
    await deliver(box, "kept", 7)
    waiting = asyncio.ensure_future(box.take("missing"))
    await asyncio.sleep(0)
    box.close(Lost("rank 0 is gone"))
    with pytest.raises(Lost):
        await waiting
    assert await box.take("kept") == 7
    with pytest.raises(Lost):
        await box.take("missing")
    with pytest.raises(Lost):
        await box.admit("late", 1)
    box.close(Lost("a second reason"))  # the first reason stays
    with pytest.raises(Lost, match="rank 0 is gone"):
        await box.take("x")


async def test_closing_fails_a_stalled_admission():
    box = Mailbox(0, max_messages=1, max_bytes=100)
    await deliver(box, "a", 1)
    stalled = asyncio.ensure_future(box.admit("b", 1))
    await asyncio.sleep(0)
    box.close(Lost("closed"))
    with pytest.raises(Lost):
        await asyncio.wait_for(stalled, 1)


async def test_a_cancelled_receive_never_loses_a_message():
    box = Mailbox(0, max_messages=4, max_bytes=100)
    taker = asyncio.ensure_future(box.take("x"))
    await asyncio.sleep(0)
    await deliver(box, "x", "value")  # delivered to the taker's future ...
    taker.cancel()  # ... which is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await taker
    assert await asyncio.wait_for(box.take("x"), 1) == "value"


async def test_a_message_whose_receiver_gave_up_after_admission_is_kept():
    box = Mailbox(0, max_messages=1, max_bytes=0)
    taker = asyncio.ensure_future(box.take("x"))
    await asyncio.sleep(0)
    reservation = await box.admit("x", 5)
    taker.cancel()
    with pytest.raises(asyncio.CancelledError):
        await taker
    box.put(reservation, "late")
    assert box.buffered_messages == 1
    assert await box.take("x") == "late"
    assert box.buffered_messages == box.buffered_bytes == 0


def test_a_mailbox_needs_room_for_a_message():
    with pytest.raises(ConfigurationError):
        Mailbox(0, max_messages=0, max_bytes=10)
