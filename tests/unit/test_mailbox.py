"""The peer mailbox without sockets: tag matching, bounded early buffering, closing."""

from __future__ import annotations

import asyncio

import pytest

from gradstar.client.peer.mailbox import MAX_TAG_CHARS, Mailbox, Mailboxes, tag_key
from gradstar.errors import ConfigurationError, RankFinishedError


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


# -- receives from any sender (Mailboxes) ----------------------------------------------------------


def boxes(senders=(1, 2, 3), max_messages=10, max_bytes=100) -> Mailboxes:
    return Mailboxes(senders, max_messages, max_bytes)


async def test_any_source_takes_held_messages_in_arrival_order_across_senders():
    post = boxes()
    for src, value in [(2, "a"), (1, "b"), (3, "c"), (2, "d")]:
        await deliver(post[src], "t", value)
    await deliver(post[1], "other tag", "x")
    got = [await post.take_any("t") for _ in range(4)]
    assert got == [(2, "a"), (1, "b"), (3, "c"), (2, "d")]
    assert post.try_take_any("t") is None
    assert await post[1].take("other tag") == "x"


async def test_concurrent_senders_keep_their_own_order_under_any_source_receives():
    post = boxes()
    takers = [asyncio.ensure_future(post.take_any("t")) for _ in range(9)]
    await asyncio.sleep(0)

    async def sender(src):
        for i in range(3):
            await deliver(post[src], "t", (src, i))
            await asyncio.sleep(0)

    await asyncio.gather(*(sender(src) for src in (1, 2, 3)))
    got = [await asyncio.wait_for(t, 1) for t in takers]
    assert sorted(src for src, _ in got) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    for src in (1, 2, 3):
        assert [value for s, (_, value) in got if s == src] == [0, 1, 2]
    assert all(s == value[0] for s, value in got)  # the reported sender sent it


async def test_a_message_goes_to_the_receive_posted_first_whichever_kind():
    post = boxes()
    first_any = asyncio.ensure_future(post.take_any("t"))
    await asyncio.sleep(0)
    then_mine = asyncio.ensure_future(post[1].take("t"))
    await asyncio.sleep(0)
    await deliver(post[1], "t", "one")
    await deliver(post[1], "t", "two")
    assert await asyncio.wait_for(first_any, 1) == (1, "one")
    assert await asyncio.wait_for(then_mine, 1) == "two"
    first_mine = asyncio.ensure_future(post[2].take("t"))
    await asyncio.sleep(0)
    then_any = asyncio.ensure_future(post.take_any("t"))
    await asyncio.sleep(0)
    await deliver(post[2], "t", "three")
    assert await asyncio.wait_for(first_mine, 1) == "three"
    assert not then_any.done()
    await deliver(post[3], "t", "four")
    assert await asyncio.wait_for(then_any, 1) == (3, "four")


async def test_an_any_source_receive_never_takes_another_tag():
    post = boxes()
    taker = asyncio.ensure_future(post.take_any("wanted"))
    await deliver(post[1], "other", 1)
    await asyncio.sleep(0.01)
    assert not taker.done()
    await deliver(post[2], "wanted", 2)
    assert await asyncio.wait_for(taker, 1) == (2, 2)
    assert await post[1].take("other") == 1


async def test_a_waiting_any_source_receive_takes_messages_without_buffering():
    post = boxes(max_messages=1, max_bytes=0)
    taker = asyncio.ensure_future(post.take_any("big"))
    await asyncio.sleep(0)
    reservation = await asyncio.wait_for(post[2].admit("big", 1000), 1)
    assert not reservation.buffered
    post[2].put(reservation, "payload")
    assert await taker == (2, "payload")


async def test_a_stalled_admission_goes_through_once_an_any_source_receive_is_posted():
    post = boxes(max_messages=1, max_bytes=10)
    await deliver(post[1], "held", 0)
    stalled = asyncio.ensure_future(post[1].admit("big", 1000))
    await asyncio.sleep(0.01)
    assert not stalled.done()
    taker = asyncio.ensure_future(post.take_any("big"))
    reservation = await asyncio.wait_for(stalled, 1)
    post[1].put(reservation, "big one")
    assert await taker == (1, "big one")


async def test_a_cancelled_any_source_receive_puts_its_message_back_first():
    post = boxes()
    taker = asyncio.ensure_future(post.take_any("t"))
    await asyncio.sleep(0)
    await deliver(post[2], "t", "first")
    await deliver(post[2], "t", "second")
    taker.cancel()
    with pytest.raises(asyncio.CancelledError):
        await taker
    assert await post.take_any("t") == (2, "first")
    assert await post[2].take("t") == "second"


async def test_any_source_waits_while_one_sender_is_open_and_fails_once_none_is():
    post = boxes()
    await deliver(post[1], "t", "kept")
    taker = asyncio.ensure_future(post.take_any("u"))
    await asyncio.sleep(0)
    post[1].close(RankFinishedError("rank 1 finished", rank=1))
    post[2].close(RankFinishedError("rank 2 finished", rank=2))
    await asyncio.sleep(0.01)
    assert not taker.done()  # rank 3 can still send it
    post[3].close(RankFinishedError("rank 3 finished", rank=3))
    with pytest.raises(RankFinishedError, match="rank 1 finished"):
        await asyncio.wait_for(taker, 1)
    assert await post.take_any("t") == (1, "kept")  # what arrived stays receivable
    with pytest.raises(RankFinishedError):
        await post.take_any("t")


async def test_when_every_sender_is_gone_a_broken_stream_outranks_a_finish():
    post = boxes()
    post[1].close(RankFinishedError("rank 1 finished", rank=1))
    post[2].close(Lost("rank 2's stream broke"))
    post[3].close(RankFinishedError("rank 3 finished", rank=3))
    with pytest.raises(Lost, match="rank 2's stream broke"):
        await post.take_any("t")


# -- receiving in place ----------------------------------------------------------------------------


async def test_a_message_is_reserved_for_the_receive_it_goes_to_with_its_destination():
    post = boxes()
    anyone = asyncio.ensure_future(post.take_any("t"))
    await asyncio.sleep(0)
    mine = asyncio.ensure_future(post[1].take("t", into="buffer"))
    await asyncio.sleep(0)
    first = await post[1].admit("t", 8)
    assert first.taker is not None and first.into is None  # the any-source receive came first
    post[1].put(first, "one")
    second = await post[1].admit("t", 8)
    assert second.into == "buffer"
    post[1].put(second, "buffer")
    assert await anyone == (1, "one") and await mine == "buffer"


async def test_a_message_written_in_place_is_detached_when_its_receive_gave_up():
    post = boxes()
    mine = asyncio.ensure_future(post[1].take("t", into=["in", "place"]))
    await asyncio.sleep(0)
    reservation = await post[1].admit("t", 8)
    written = reservation.into
    mine.cancel()  # the receive gives up while the message is being written into its buffer
    with pytest.raises(asyncio.CancelledError):
        await mine
    later = asyncio.ensure_future(post.take_any("t"))
    await asyncio.sleep(0)
    post[1].put(reservation, written, detach=list)
    src, got = await asyncio.wait_for(later, 1)
    assert src == 1 and got == ["in", "place"] and got is not written


async def test_a_cancelled_receive_detaches_the_message_it_got_in_place_before_putting_it_back():
    post = boxes()
    buffer = ["x"]
    mine = asyncio.ensure_future(post[1].take("t", into=buffer))
    await asyncio.sleep(0)
    reservation = await post[1].admit("t", 8)
    post[1].put(reservation, buffer, detach=list)
    mine.cancel()  # delivered, but cancelled before it resumed
    with pytest.raises(asyncio.CancelledError):
        await mine
    got = await post[1].take("t")
    assert got == ["x"] and got is not buffer
