"""Point to point in the asyncio process group: ``send`` and ``recv`` (from one rank or any)
and the all_to_all calls, which all ride the ranks' peer streams
(:mod:`gradstar.client.peer`) rather than the hub's collective streams. An all_to_all's plans
are a hub collective, checked and ordered like any other; its payload goes rank to rank
(:mod:`gradstar.client.all_to_all`).

:class:`PointToPoint` is mixed into :class:`~gradstar.client.process_group.AsyncProcessGroup`,
which gives it ``rank``, ``world_size``, ``peers``, ``settings``, the peer endpoint, the
all_to_all call numbers and the collective machinery (``_call``, ``_issue``, ``_collect``,
``_check_usable``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import numpy as np

from gradstar import ops
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
from ..peer.mailbox import tag_key

T = TypeVar("T")


class PointToPoint:
    """The calls of :class:`~gradstar.client.process_group.AsyncProcessGroup` that move
    payloads over peer streams."""

    # -- all_to_all (plans through the hub, payload over peer streams) ------------------------

    def all_to_all(self, inputs, *, timeout: float | None = None) -> Awaitable[list]:
        """Send ``inputs[j]`` to rank ``j``; resolves to a list whose element ``i`` is what rank
        ``i`` sent this rank, with the shape it was sent with and the type of this rank's
        inputs. Every array has the same dtype; shapes are free. The hub checks and orders the
        call, the arrays ride peer streams (:mod:`gradstar.client.all_to_all`).

        Raises:
            InvalidCollectiveError: not one array per rank, or arrays of different dtypes.
            ConfigurationError: an unsupported array type or dtype, or a rank of the group
                without a peer address.
            CollectiveMismatchError: (on every rank) ranks called other collectives, or passed
                other dtypes.
            CollectiveError and subclasses: timeout, lost or finished rank, as for all_reduce.
        """
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
        """Split ``x`` along dim 0 by ``input_split_sizes`` and send split ``j`` to rank ``j``;
        resolves to one array of x's type: the splits received from ranks 0, 1, ... one after
        the other along dim 0, ``output_split_sizes[i]`` rows from rank ``i``. None (or empty)
        means equal splits of ``x``'s dim 0, as in torch.distributed. Rank ``i``'s
        ``input_split_sizes[j]`` must equal rank ``j``'s ``output_split_sizes[i]``.

        Raises:
            InvalidCollectiveError: a 0-d ``x``, or split sizes that are not one non-negative
                int per rank, or (input) do not sum to dim 0, or (None) dim 0 not divisible by
                the world size.
            CollectiveMismatchError: (on every rank) ranks disagree on split sizes, dtype or row
                size, or called other collectives; the message names both ranks and sizes.
            ConfigurationError, CollectiveError and subclasses: as for :meth:`all_to_all`.
        """
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
        """Take the call's seq now (its plan is a hub collective) and return the coroutine that
        checks every rank's plan and moves ``pieces[j]`` to rank ``j`` (see
        :mod:`gradstar.client.all_to_all`); ``deliver`` turns what arrived, by sender, into
        the result. ``into[i]``: where rank ``i``'s piece may be received in place."""
        unreachable = [r for r in range(self.world_size)
                       if r != self.rank and not self.peers.get(r)]
        if unreachable or (self._peer_endpoint is None and self.world_size > 1):
            raise ConfigurationError(
                f"{plan.name} moves its payload over peer streams, but ranks {unreachable} "
                "registered no peer address: a rank configured for TLS needs tls_cert and "
                "tls_key to serve peer streams")
        timeout = self.settings.timeout if timeout is None else timeout
        encoded = plan.encode()
        plans = np.empty((self.world_size, encoded.size), dtype=np.int64)
        plans[self.rank] = encoded  # this rank's segment: sent from here, never received
        exchange, timeout = self._call(ops.ALL_TO_ALL, encoded, timeout)
        call = next(self._all_to_all_calls)
        return self._issue(exchange, lambda: self._move(
            self._collect(exchange, plans, plans, lambda r: r, timeout), call, plan, pieces,
            kind, deliver, timeout, into))

    async def _move(self, exchange: Awaitable, call: int, plan: a2a.Plan,
                    pieces: list[np.ndarray], kind: int, deliver, timeout: float,
                    into: list[np.ndarray] | None):
        """The all_to_all itself, once its seq is taken: every plan checked (the same verdict
        on every rank), then receives posted and pieces sent over the peer streams."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        plans = [a2a.Plan.decode(row, self.world_size) for row in await exchange]
        a2a.check_plans(plans, f"{plan.name} call {call}")
        me, tag, peers = self.rank, a2a.payload_tag(call), self._peer_endpoint
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
        """Send ``x`` to rank ``dst`` over this rank's peer stream to it; resolves to None once
        ``dst`` holds the whole message. Do not modify ``x`` until then.

        ``tag`` (an int, a str, or a tuple of them) is what ``recv`` matches; messages with the
        same tag from one rank arrive in the order they were sent.

        Raises:
            ConfigurationError: bad ``dst``, tag, dtype or type of ``x``.
            RankLostError: ``dst`` (or another rank of the generation) was lost.
            CollectiveTimeoutError: ``dst`` did not take the message within ``timeout``.
            AuthenticationError: ``dst``'s peer server refused the job token.
        """
        arr, _ = to_numpy(x)
        dst, key = self._peer_check(dst, "send to"), tag_key(tag)
        self._check_usable()
        timeout = self.settings.timeout if timeout is None else timeout
        return self._peer_endpoint.send(arr, array_kind(x), dst, key, timeout)

    def recv(self, src: int | None = None, tag=0, *,
             timeout: float | None = None) -> Awaitable[ArrayLike]:
        """The next message from rank ``src`` with ``tag``, as the type it was sent as (numpy
        array, or torch tensor where torch is installed), with its shape and dtype.

        ``src=None`` receives the next message with ``tag`` from any other rank and resolves to
        ``(sender, x)``. Messages of one sender are received in the order it sent them,
        whichever kind of recv takes them; among senders, the message that arrived first.

        A message that already arrived is returned even if the generation failed, or its
        sender finished, since.

        Raises:
            ConfigurationError: bad ``src`` or tag, or (``src=None``) no other rank.
            RankFinishedError: ``src`` (``src=None``: every other rank) closed its group
                cleanly, and everything it sent before has been received.
            RankLostError: ``src`` (or another rank of the generation) was lost.
            CollectiveTimeoutError: no such message arrived within ``timeout``.
        """
        src = self._peer_check(src, "receive from", any_source=True)
        key = tag_key(tag)
        if src is None and self.world_size == 1:
            raise ConfigurationError(
                f"rank {self.rank} has no other rank to receive from (world_size 1)")
        if self._closed:  # (a failed generation is checked later: see above)
            self._check_usable()
        timeout = self.settings.timeout if timeout is None else timeout
        peers = self._peer_endpoint

        async def receive():
            if src is None:
                sender, (arr, kind) = await peers.recv_any(key, timeout)
                return sender, restore_array(arr, kind)
            return restore_array(*await peers.recv(src, key, timeout))

        return receive()

    def _peer_check(self, peer: int | None, what: str, *, any_source: bool = False) -> int | None:
        if self._peer_endpoint is None:
            raise ConfigurationError("this process group has no peer endpoint for send/recv")
        if peer is None and any_source:
            return None
        if isinstance(peer, bool) or not isinstance(peer, int | np.integer) or not (
                0 <= peer < self.world_size) or peer == self.rank:
            raise ConfigurationError(
                f"rank {self.rank} cannot {what} rank {peer!r}: it must be another rank in "
                f"0..{self.world_size - 1}")
        return int(peer)


__all__ = ["PointToPoint"]
