"""Messages from peer ranks, matched to receives by tag (and, for ``src=None``, from any
sender), with bounded early buffering.

This module does no I/O: the peer server drives a :class:`Mailbox` per sending rank, and
``recv`` takes from it. A message is *early* when it arrives before anybody receives its tag;
early messages are buffered up to ``max_messages`` and ``max_bytes``. A message whose tag a
receiver is already waiting for goes straight to that receiver and takes no buffer space, so a
posted receive of any size always completes. When the buffer is full, :meth:`Mailbox.admit`
waits, the peer server stops reading the stream, and HTTP/2 flow control holds the sender back:
the memory a rank spends on early messages never exceeds the bound (give or take one message per
sender whose receiver went elsewhere or gave up between admission and delivery).

Receiving from any sender (:meth:`Mailboxes.take_any`). One clock orders, across all of a rank's
mailboxes, the arrivals of held messages and the receives that are posted:

* a receive finds the held message with its tag that arrived first, from whichever sender;
* an arriving message goes to the receive posted first among those that can take it (a receive
  for its sender and tag, or a receive for its tag from any sender);
* messages of one sender with one tag are taken in the order they were sent, whichever kind of
  receive takes them, because each mailbox keeps them in a FIFO per tag.

A receive from any sender fails only once every sender's mailbox is closed and none holds its
tag (a sender that finished or broke its stream cannot send it any more; the others still can).

Receiving in place: a receive may offer a destination (``take(tag, into=...)``). A message
admitted while that receive is the one it will go to is reserved for it
(:attr:`Reservation.taker`) and the peer server may write it straight into the destination; if
the receive gives up before the message is complete, :meth:`Mailbox.put` detaches the message
from the destination (a copy) before anyone else gets it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gradstar.errors import ConfigurationError, RankFinishedError

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
    """Room for one incoming message: ``buffered`` if it took early-buffer space; ``taker``:
    the waiting receive it goes to, whose destination (:attr:`into`) it may be written into."""

    tag: str
    nbytes: int
    buffered: bool
    taker: _Taker | None = None

    @property
    def into(self):
        return None if self.taker is None else self.taker.into


@dataclass(eq=False)
class _Taker:
    """A posted receive: ``ticket`` on the shared clock, resolved with the message (or, for a
    receive from any sender, with ``(src, message)``); ``into``: where it would like the message
    written, if anywhere."""

    ticket: int
    future: asyncio.Future
    into: object = None
    any_source: bool = False
    #: Set when the message it got was written into ``into``: how to copy it out of there.
    detach: Callable[[object], object] | None = None

    @property
    def waiting(self) -> bool:
        return not self.future.done()


def _first_waiting(takers: deque[_Taker] | None) -> _Taker | None:
    while takers and not takers[0].waiting:
        takers.popleft()
    return takers[0] if takers else None


class _Shared:
    """What one rank's mailboxes share: the clock and the receives posted for any sender."""

    def __init__(self) -> None:
        self.clock = itertools.count()
        self.any_takers: dict[str, deque[_Taker]] = {}
        self.mailboxes: list[Mailbox] = []

    def on_closed(self) -> None:
        """A mailbox closed: if all are, no receive from any sender can complete any more."""
        error = closing_error(self.mailboxes)
        if error is None:
            return
        for takers in self.any_takers.values():
            for taker in takers:
                if taker.waiting:
                    taker.future.set_exception(error)


def closing_error(mailboxes: Iterable[Mailbox]) -> BaseException | None:
    """Why a receive from any of ``mailboxes`` cannot complete: None while one is open; else the
    first error that is not a sender finishing (a broken stream, this rank closing), else the
    first sender's finish."""
    errors = [box._error for box in mailboxes]
    if not errors or any(e is None for e in errors):
        return None
    return next((e for e in errors if not isinstance(e, RankFinishedError)), errors[0])


class Mailbox:
    """Messages from rank ``src``: FIFO per tag, matched against waiting receivers.

    The peer server calls :meth:`admit` when a message header arrives (before allocating for
    it) and :meth:`put` when the message is complete; ``recv`` calls :meth:`take`. After
    :meth:`close` (the stream ended or broke) messages already held stay receivable, and every
    other receive raises the closing error. A mailbox made by :class:`Mailboxes` also serves
    that rank's receives from any sender.
    """

    def __init__(self, src: int, max_messages: int, max_bytes: int,
                 shared: _Shared | None = None) -> None:
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
        self._shared = shared if shared is not None else _Shared()
        self._shared.mailboxes.append(self)
        #: tag -> (arrival ticket, reservation, message), oldest first.
        self._held: dict[str, deque[tuple[int, Reservation, object]]] = {}
        self._takers: dict[str, deque[_Taker]] = {}
        self._changed = asyncio.Event()
        self._error: BaseException | None = None

    @property
    def closed(self) -> bool:
        return self._error is not None

    @property
    def error(self) -> BaseException | None:
        """Why the mailbox closed, or None while it is open."""
        return self._error

    def held_tags(self) -> list[str]:
        return [tag for tag, items in self._held.items() for _ in items]

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
                taker = self._next_taker(tag)
                if taker is not None:
                    return Reservation(tag, nbytes, buffered=False, taker=taker)
                if self._room_for(nbytes):
                    self.buffered_messages += 1
                    self.buffered_bytes += nbytes
                    self.peak_buffered_bytes = max(self.peak_buffered_bytes, self.buffered_bytes)
                    return Reservation(tag, nbytes, buffered=True)
                self._changed.clear()
                await self._changed.wait()
        finally:
            self.stalled_on = None

    def _next_taker(self, tag: str) -> _Taker | None:
        """The waiting receive a message with ``tag`` goes to: the one posted first."""
        own = _first_waiting(self._takers.get(tag))
        anyone = _first_waiting(self._shared.any_takers.get(tag))
        if anyone is not None and (own is None or anyone.ticket < own.ticket):
            return anyone
        return own

    def put(self, reservation: Reservation, value, detach=None) -> None:
        """Deliver a complete message admitted with ``reservation``: to the receive it was
        reserved for, else the receive posted first that can take it, else into the buffer.
        ``detach(value)``: a copy of a message written into its reserved receive's destination,
        for when that receive gave up meanwhile."""
        tag = reservation.tag
        taker = reservation.taker
        if taker is not None and taker.waiting:
            taker.detach = detach
        else:
            if taker is not None and detach is not None:
                value = detach(value)
            taker = self._next_taker(tag)
        if taker is not None:
            self._release(reservation)
            taker.future.set_result((self.src, value) if taker.any_source else value)
            return
        if not reservation.buffered:
            # Its receiver gave up (timeout), or took a message from another sender, after
            # admission: keep it anyway, over the bound for this one message, rather than lose it.
            reservation.buffered = True
            self.buffered_messages += 1
            self.buffered_bytes += reservation.nbytes
        self._held.setdefault(tag, deque()).append(
            (next(self._shared.clock), reservation, value))

    def _release(self, reservation: Reservation) -> None:
        if reservation.buffered:
            self.buffered_messages -= 1
            self.buffered_bytes -= reservation.nbytes
            self._changed.set()

    def _oldest(self, tag: str) -> int | None:
        """The arrival ticket of the oldest held message with ``tag``, or None."""
        held = self._held.get(tag)
        return held[0][0] if held else None

    def try_take(self, tag: str):
        """(True, message) if a message with ``tag`` is held, else (False, None)."""
        held = self._held.get(tag)
        if not held:
            return False, None
        _, reservation, value = held.popleft()
        if not held:
            del self._held[tag]
        self._release(reservation)
        return True, value

    def _put_back(self, tag: str, ticket: int, value) -> None:
        """A message handed to a receive that was cancelled before it resumed: first again."""
        self._held.setdefault(tag, deque()).appendleft(
            (ticket, Reservation(tag, 0, buffered=False), value))

    async def take(self, tag: str, into=None):
        """The next message with ``tag``, waiting for it if needed. ``into``: a destination the
        peer server may write the message straight into (then the message *is* ``into``).

        Cancelling a take never loses a message: one delivered in the meantime is put back.

        Raises:
            The closing error, if the mailbox is (or gets) closed before the message arrives.
        """
        found, value = self.try_take(tag)
        if found:
            return value
        if self._error is not None:
            raise self._error
        taker = _Taker(next(self._shared.clock), asyncio.get_running_loop().create_future(),
                       into)
        self._takers.setdefault(tag, deque()).append(taker)
        self._changed.set()  # a stalled admission may be waiting for exactly this receiver
        try:
            return await taker.future
        except asyncio.CancelledError:
            future = taker.future
            if future.done() and not future.cancelled() and future.exception() is None:
                value = future.result()
                self._put_back(tag, taker.ticket,
                               value if taker.detach is None else taker.detach(value))
            raise
        finally:
            _forget(self._takers, tag, taker)

    def close(self, error: BaseException) -> None:
        """No more messages will come: fail waiting receivers and admissions with ``error``."""
        if self._error is not None:
            return
        self._error = error
        for takers in self._takers.values():
            for taker in takers:
                if taker.waiting:
                    taker.future.set_exception(error)
        self._changed.set()
        self._shared.on_closed()


def _forget(takers_by_tag: dict[str, deque[_Taker]], tag: str, taker: _Taker) -> None:
    takers = takers_by_tag.get(tag)
    if takers is not None:
        if taker in takers:
            takers.remove(taker)
        if not takers:
            del takers_by_tag[tag]


class Mailboxes:
    """A rank's mailboxes, one per sending rank, and receives from any of them.

    ``mailboxes[src]`` is the :class:`Mailbox` of rank ``src``; :meth:`take_any` receives the
    next message with a tag from whichever sender (the ordering rules are in the module
    docstring).
    """

    def __init__(self, senders: Iterable[int], max_messages: int, max_bytes: int) -> None:
        self._shared = _Shared()
        self._by_rank = {src: Mailbox(src, max_messages, max_bytes, self._shared)
                         for src in senders}

    def __getitem__(self, src: int) -> Mailbox:
        return self._by_rank[src]

    def get(self, src: int) -> Mailbox | None:
        return self._by_rank.get(src)

    def values(self):
        return self._by_rank.values()

    def try_take_any(self, tag: str):
        """(src, message) of the held message with ``tag`` that arrived first, or None."""
        oldest = [(ticket, box) for box in self._by_rank.values()
                  if (ticket := box._oldest(tag)) is not None]
        if not oldest:
            return None
        _, box = min(oldest, key=lambda pair: pair[0])
        _, value = box.try_take(tag)
        return box.src, value

    def closing_error(self) -> BaseException | None:
        """Why no receive from any sender can complete (see :func:`closing_error`), or None."""
        return closing_error(self._by_rank.values())

    async def take_any(self, tag: str):
        """The next message with ``tag`` from any sender, as ``(src, message)``.

        Cancelling it never loses a message: one delivered in the meantime is put back, first
        in its sender's mailbox.

        Raises:
            The closing error of :meth:`closing_error`, once every mailbox is closed and none
            holds a message with ``tag``.
        """
        found = self.try_take_any(tag)
        if found is not None:
            return found
        error = self.closing_error()
        if error is not None:
            raise error
        shared = self._shared
        taker = _Taker(next(shared.clock), asyncio.get_running_loop().create_future(),
                       any_source=True)
        shared.any_takers.setdefault(tag, deque()).append(taker)
        for box in self._by_rank.values():
            box._changed.set()  # stalled admissions may be waiting for exactly this receiver
        try:
            return await taker.future
        except asyncio.CancelledError:
            future = taker.future
            if future.done() and not future.cancelled() and future.exception() is None:
                src, value = future.result()
                self._by_rank[src]._put_back(tag, taker.ticket, value)
            raise
        finally:
            _forget(shared.any_takers, tag, taker)

    def close(self, error: BaseException) -> None:
        """Close every mailbox with ``error`` (one already closed keeps its own reason)."""
        for box in self._by_rank.values():
            box.close(error)
