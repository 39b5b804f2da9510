"""Messages from one peer rank, matched to receives by tag, with bounded early buffering.

This module does no I/O: the peer server drives a :class:`Mailbox` per sending rank, and
``recv`` takes from it. A message is *early* when it arrives before anybody receives its tag;
early messages are buffered up to ``max_messages`` and ``max_bytes``. A message whose tag a
receiver is already waiting for goes straight to that receiver and takes no buffer space, so a
posted receive of any size always completes. When the buffer is full, :meth:`Mailbox.admit`
waits, the peer server stops reading the stream, and HTTP/2 flow control holds the sender back:
the memory a rank spends on early messages never exceeds the bound.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from dataclasses import dataclass

from gradstar.errors import ConfigurationError

Tag = int | str | tuple
MAX_TAG_CHARS = 512


def tag_key(tag: Tag) -> str:
    """The canonical wire form of a tag: JSON of an int, a string, or a list of them.

    ``1``, ``"1"`` and ``(1,)`` are different tags; ``(3, "act")`` and ``[3, "act"]`` are the same.

    Raises:
        ConfigurationError: the tag is not an int, a str, or a tuple/list of ints and strs.
    """
    def plain(value):
        return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))

    if plain(tag):
        key = json.dumps(tag)
    elif isinstance(tag, tuple | list) and all(plain(v) for v in tag):
        key = json.dumps(list(tag))
    else:
        raise ConfigurationError(
            f"a tag is an int, a str, or a tuple of ints and strs; got {tag!r}"
        )
    if len(key) > MAX_TAG_CHARS:
        raise ConfigurationError(f"tag {key[:40]}... is longer than {MAX_TAG_CHARS} characters")
    return key


@dataclass
class Reservation:
    """Room for one incoming message: ``buffered`` if it took early-buffer space."""

    tag: str
    nbytes: int
    buffered: bool


class Mailbox:
    """Messages from rank ``src``: FIFO per tag, matched against waiting receivers.

    The peer server calls :meth:`admit` when a message header arrives (before allocating for
    it) and :meth:`put` when the message is complete; ``recv`` calls :meth:`take`. After
    :meth:`close` (the stream ended or broke) messages already held stay receivable, and every
    other receive raises the closing error.
    """

    def __init__(self, src: int, max_messages: int, max_bytes: int) -> None:
        if max_messages < 1 or max_bytes < 0:
            raise ConfigurationError("a mailbox needs room for at least one message")
        self.src = src
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.buffered_messages = 0
        self.buffered_bytes = 0
        self.peak_buffered_bytes = 0
        #: The tag of the message that waits for buffer space, if any (for error messages).
        self.stalled_on: str | None = None
        self._held: dict[str, deque] = {}
        self._takers: dict[str, deque[asyncio.Future]] = {}
        self._changed = asyncio.Event()
        self._error: BaseException | None = None

    @property
    def closed(self) -> bool:
        return self._error is not None

    def held_tags(self) -> list[str]:
        return [tag for tag, items in self._held.items() for _ in items]

    def _has_taker(self, tag: str) -> bool:
        return any(not f.done() for f in self._takers.get(tag, ()))

    def _room_for(self, nbytes: int) -> bool:
        return (self.buffered_messages < self.max_messages
                and self.buffered_bytes + nbytes <= self.max_bytes)

    async def admit(self, tag: str, nbytes: int) -> Reservation:
        """Wait until a message of ``nbytes`` with ``tag`` may be received; reserve room for it.

        Raises:
            The closing error, if the mailbox is closed while waiting.
        """
        self.stalled_on = tag
        try:
            while True:
                if self._error is not None:
                    raise self._error
                if self._has_taker(tag):
                    return Reservation(tag, nbytes, buffered=False)
                if self._room_for(nbytes):
                    self.buffered_messages += 1
                    self.buffered_bytes += nbytes
                    self.peak_buffered_bytes = max(self.peak_buffered_bytes, self.buffered_bytes)
                    return Reservation(tag, nbytes, buffered=True)
                self._changed.clear()
                await self._changed.wait()
        finally:
            self.stalled_on = None

    def put(self, reservation: Reservation, value) -> None:
        """Deliver a complete message admitted with ``reservation``."""
        takers = self._takers.get(reservation.tag)
        while takers:
            taker = takers.popleft()
            if not taker.done():
                self._release(reservation)
                taker.set_result(value)
                return
        if not reservation.buffered:
            # Its receiver gave up (timeout) after admission: keep it anyway, over the bound for
            # this one message, rather than lose it.
            reservation.buffered = True
            self.buffered_messages += 1
            self.buffered_bytes += reservation.nbytes
        self._held.setdefault(reservation.tag, deque()).append((reservation, value))

    def _release(self, reservation: Reservation) -> None:
        if reservation.buffered:
            self.buffered_messages -= 1
            self.buffered_bytes -= reservation.nbytes
            self._changed.set()

    def try_take(self, tag: str):
        """(True, message) if a message with ``tag`` is held, else (False, None)."""
        held = self._held.get(tag)
        if not held:
            return False, None
        reservation, value = held.popleft()
        if not held:
            del self._held[tag]
        self._release(reservation)
        return True, value

    async def take(self, tag: str):
        """The next message with ``tag``, waiting for it if needed.

        Cancelling a take never loses a message: one delivered in the meantime is put back.

        Raises:
            The closing error, if the mailbox is (or gets) closed before the message arrives.
        """
        found, value = self.try_take(tag)
        if found:
            return value
        if self._error is not None:
            raise self._error
        taker = asyncio.get_running_loop().create_future()
        self._takers.setdefault(tag, deque()).append(taker)
        self._changed.set()  # a stalled admission may be waiting for exactly this receiver
        try:
            return await taker
        except asyncio.CancelledError:
            if taker.done() and not taker.cancelled() and taker.exception() is None:
                self._held.setdefault(tag, deque()).appendleft(
                    (Reservation(tag, 0, buffered=False), taker.result()))
            raise
        finally:
            takers = self._takers.get(tag)
            if takers is not None:
                if taker in takers:
                    takers.remove(taker)
                if not takers:
                    del self._takers[tag]

    def close(self, error: BaseException) -> None:
        """No more messages will come: fail waiting receivers and admissions with ``error``."""
        if self._error is not None:
            return
        self._error = error
        for takers in self._takers.values():
            for taker in takers:
                if not taker.done():
                    taker.set_exception(error)
        self._changed.set()
