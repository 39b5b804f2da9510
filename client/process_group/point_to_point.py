"""Point to point in the asyncio process group: ``send`` and ``recv`` (from one rank or any)
and the all_to_all calls, which all ride the ranks' peer streams
(:mod:`gradstar.client.peer`) rather than the hub's collective streams. An all_to_all's plans
are a hub collective, checked and ordered like any other; its payload goes rank to rank
(:mod:`gradstar.client.all_to_all`).

:class:`PeerCalls` is the object an :class:`~gradstar.client.process_group.AsyncProcessGroup`
owns for these calls (the group's methods of the same names delegate to it, and their
docstrings are the contract): it is given the group's place (rank, world size, the peers'
addresses), its peer endpoint, its default timeout and, as callables, the few things it asks
of the group (is it usable, is it open, the plan exchange through the hub).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import TypeVar

import numpy as np

from gradstar.errors import ConfigurationError, InvalidCollectiveError, ProtocolError
from gradstar.wire import dtype_info

from .. import all_to_all as a2a
from ..convert import (
    ArrayLike,
    array_kind,
    copies_to_device,
    copying_to_device,
    delivered,
    restore_array,
    to_numpy,
)
from ..peer import PeerEndpoint
from ..peer.mailbox import tag_key

T = TypeVar("T")

#: The group's plan exchange of an all_to_all: ``exchange(encoded, timeout, then)`` takes the
#: seq of a hub collective that gathers every rank's ``encoded`` plan, now (raising what a
#: closed or failed group raises), and issues it; the issued call runs ``then(plans,
#: timeout)``, ``plans`` resolving to every rank's plan by rank.
PlanExchange = Callable[
    [np.ndarray, float, Callable[[Awaitable[np.ndarray], float], Coroutine]], Awaitable]


class PeerCalls:
    """The calls of one :class:`~gradstar.client.process_group.AsyncProcessGroup` that move
    payloads over peer streams (see the module docstring).

    ``check_usable()`` raises if the group is closed or its generation failed,
    ``check_open()`` only if it is closed (a message that arrived is received after a
    failure); ``exchange`` is the group's :data:`PlanExchange`."""

    def __init__(self, rank: int, world_size: int, peers: dict[int, str],
                 endpoint: PeerEndpoint | None, timeout: float, *,
                 check_usable: Callable[[], None], check_open: Callable[[], None],
                 exchange: PlanExchange) -> None:
        self.rank = rank
        self.world_size = world_size
        self.peers = peers
        self.endpoint = endpoint
        self.timeout = timeout
        self._check_usable = check_usable
        self._check_open = check_open
        self._exchange = exchange
        #: all_to_all calls made so far: their numbers are their payload's peer tags.
        self._all_to_all_calls = 0

    # -- all_to_all (plans through the hub, payload over peer streams) ------------------------

    def all_to_all(self, inputs, *, timeout: float | None = None) -> Awaitable[list]:
        """As :meth:`~gradstar.client.process_group.AsyncProcessGroup.all_to_all`."""
        inputs = list(inputs)
        converted = [to_numpy(x) for x in inputs]
        if len(converted) != self.world_size:
            raise InvalidCollectiveError(
                f"all_to_all needs one array per rank ({self.world_size}), got {len(converted)}")
        arrays = [arr for arr, _ in converted]
        dtypes = sorted({str(arr.dtype) for arr in arrays})
        if len(dtypes) > 1:
            raise InvalidCollectiveError(f"all_to_all's arrays must share one dtype, got {dtypes}")
        restore = converted[0][1]
        plan = a2a.Plan(a2a.LIST, dtype_info(arrays[0].dtype).wire, 1,
                        tuple(arr.size for arr in arrays), (a2a.ANY,) * self.world_size)

        def deliver(received: dict[int, np.ndarray]) -> list:
            received[self.rank] = arrays[self.rank].copy()
            return [restore(received[r]) for r in range(self.world_size)]

        return self._all_to_all(plan, arrays, array_kind(inputs[0]),
                                copying_to_device(deliver, copies_to_device(restore)), timeout)

    def all_to_all_single(self, x, output_split_sizes=None, input_split_sizes=None, *,
                          timeout: float | None = None) -> Awaitable[ArrayLike]:
        """As :meth:`~gradstar.client.process_group.AsyncProcessGroup.all_to_all_single`."""
        arr, restore = to_numpy(x)
        if arr.ndim == 0:
            raise InvalidCollectiveError("all_to_all_single needs a tensor of at least 1 "
                                         "dimension, got a 0-d one")
        rows = arr.shape[0]
        sends = a2a.split_sizes(input_split_sizes, rows, self.world_size, "input_split_sizes")
        expects = a2a.split_sizes(output_split_sizes, None if output_split_sizes else rows,
                                  self.world_size, "output_split_sizes")
        plan = a2a.Plan(a2a.SINGLE, dtype_info(arr.dtype).wire, a2a.row_elements(arr.shape),
                        tuple(sends), tuple(expects))
        at, to = a2a.offsets(sends), a2a.offsets(expects)
        out = np.empty((to[-1], *arr.shape[1:]), dtype=arr.dtype)
        splits = [out[to[i]:to[i + 1]] for i in range(self.world_size)]

        def deliver(received: dict[int, np.ndarray]) -> object:
            me = self.rank
            splits[me][...] = arr[at[me]:at[me + 1]]
            for src, got in received.items():
                if got is not splits[src]:  # not received in place
                    splits[src][...] = got.reshape(splits[src].shape)
            return restore(out)

        pieces = [arr[at[j]:at[j + 1]] for j in range(self.world_size)]
        return self._all_to_all(plan, pieces, array_kind(x),
                                copying_to_device(deliver, copies_to_device(restore)), timeout,
                                splits)

    def _all_to_all(self, plan: a2a.Plan, pieces: list[np.ndarray], kind: int, deliver,
                    timeout: float | None,
                    into: list[np.ndarray] | None = None) -> Awaitable[T]:
        """Take the call's seq now (its plan exchange is a hub collective) and return the call
        that checks every rank's plan and moves ``pieces[j]`` to rank ``j`` (see
        :mod:`gradstar.client.all_to_all`); ``deliver`` turns what arrived, by sender, into
        the result. ``into[i]``: where rank ``i``'s piece may be received in place."""
        unreachable = [r for r in range(self.world_size)
                       if r != self.rank and not self.peers.get(r)]
        if unreachable or (self.endpoint is None and self.world_size > 1):
            raise ConfigurationError(
                f"{plan.name} moves its payload over peer streams, but ranks {unreachable} "
                "registered no peer address: a rank configured for TLS needs tls_cert and "
                "tls_key to serve peer streams")
        timeout = self.timeout if timeout is None else timeout
        call = self._all_to_all_calls + 1  # counted once the exchange's seq is taken
        started = self._exchange(plan.encode(), timeout, lambda plans, left: self._move(
            plans, call, plan, pieces, kind, deliver, left, into))
        self._all_to_all_calls = call
        return started

    async def _move(self, exchange: Awaitable, call: int, plan: a2a.Plan,
                    pieces: list[np.ndarray], kind: int, deliver, timeout: float,
                    into: list[np.ndarray] | None):
        """The all_to_all itself, once its seq is taken: every plan checked (the same verdict
        on every rank), then receives posted and pieces sent over the peer streams."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        plans = [a2a.Plan.decode(row, self.world_size) for row in await exchange]
        a2a.check_plans(plans, f"{plan.name} call {call}")
        me, tag, peers = self.rank, a2a.payload_tag(call), self.endpoint
        others = [r for r in range(self.world_size) if r != me]
        # A single tensor's empty splits need no message: both sides know their shape.
        skip_empty = plan.form == a2a.SINGLE
        sources = [r for r in others if not (skip_empty and plans[r].sends[me] == 0)]
        targets = [r for r in others if not (skip_empty and plan.sends[r] == 0)]
        left = max(deadline - loop.time(), 0.0)
        receives = [asyncio.ensure_future(peers.recv(src, tag, left,
                                                     None if into is None else into[src]))
                    for src in sources]
        sends = [asyncio.ensure_future(peers.send(pieces[dst], kind, dst, tag, left))
                 for dst in targets]
        try:
            # Shielded: a send cancelled mid-message would end its stream for every later
            # message, so on failure or cancellation each finishes or fails on its own
            # (bounded by the timeout). The receives are cancelled; a piece arriving after that
            # stays unclaimed in this rank's mailbox (its tag is never used again).
            await asyncio.gather(*receives, *(asyncio.shield(task) for task in sends))
        except BaseException:
            for task in receives:
                task.cancel()
            raise
        received = {}
        for src, task in zip(sources, receives, strict=True):
            got, _ = task.result()
            elements = plans[src].sends[me] * plan.row_elems
            if got.dtype != pieces[me].dtype or got.size != elements:
                raise ProtocolError(
                    f"{plan.name} call {call}: rank {src} sent rank {me} {got.size} elements "
                    f"of {got.dtype}; its plan said {elements} of {pieces[me].dtype}")
            received[src] = got
        return await delivered(deliver, received)

    # -- point to point (peer streams, see gradstar.client.peer) --------------------------------

    def send(self, x, dst: int, tag=0, *, timeout: float | None = None) -> Awaitable[None]:
        """As :meth:`~gradstar.client.process_group.AsyncProcessGroup.send`."""
        arr, _ = to_numpy(x)
        dst, key = self._peer_check(dst, "send to"), tag_key(tag)
        self._check_usable()
        timeout = self.timeout if timeout is None else timeout
        return self.endpoint.send(arr, array_kind(x), dst, key, timeout)

    def recv(self, src: int | None = None, tag=0, *,
             timeout: float | None = None) -> Awaitable[ArrayLike]:
        """As :meth:`~gradstar.client.process_group.AsyncProcessGroup.recv`."""
        src = self._peer_check(src, "receive from", any_source=True)
        key = tag_key(tag)
        if src is None and self.world_size == 1:
            raise ConfigurationError(
                f"rank {self.rank} has no other rank to receive from (world_size 1)")
        # Closed, not failed: a message that arrived is received after a failure too.
        self._check_open()
        timeout = self.timeout if timeout is None else timeout
        peers = self.endpoint

        async def receive():
            if src is None:
                sender, (arr, kind) = await peers.recv_any(key, timeout)
                return sender, restore_array(arr, kind)
            return restore_array(*await peers.recv(src, key, timeout))

        return receive()

    def _peer_check(self, peer: int | None, what: str, *, any_source: bool = False) -> int | None:
        if self.endpoint is None:
            raise ConfigurationError("this process group has no peer endpoint for send/recv")
        if peer is None and any_source:
            return None
        if isinstance(peer, bool) or not isinstance(peer, int | np.integer) or not (
                0 <= peer < self.world_size) or peer == self.rank:
            raise ConfigurationError(
                f"rank {self.rank} cannot {what} rank {peer!r}: it must be another rank in "
                f"0..{self.world_size - 1}")
        return int(peer)


__all__ = ["PeerCalls", "PlanExchange"]
