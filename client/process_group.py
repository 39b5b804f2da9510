"""Process groups: the rank's handle on its job. ``AsyncProcessGroup`` does the work;
``ProcessGroup`` runs it on a private event-loop thread for blocking code.

Every collective takes its sequence number when it is *called*, not when it is awaited, so
collectives issued in the same order on every rank match on the hub even when several run
concurrently (``async_op=True`` or ``asyncio.gather``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import threading
from collections.abc import Awaitable

import grpc
import numpy as np
from pydantic import SecretStr

from gradstar import ops
from gradstar.allocator import tune_allocator
from gradstar.config import ClientSettings
from gradstar.errors import (
    ConfigurationError,
    GradstarError,
    InvalidCollectiveError,
    ProcessGroupClosedError,
    ProtocolError,
)
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.transport.channels import call_metadata, open_channel
from gradstar.transport.tls_check import wait_connected
from gradstar.wire import aligned_chunk_bytes, dtype_info

from . import all_to_all as a2a
from .coalesced import all_reduce_coalesced
from .collective_stream import abandon_collective, issue, run_collective
from .convert import (
    array_kind,
    copies_to_device,
    copying_to_device,
    delivered,
    is_cpu_tensor,
    restore_array,
    to_numpy,
)
from .data_plane import DataPlane, striped_chunk_bytes
from .hierarchy import HostHierarchy
from .peer import Identity, PeerEndpoint
from .peer.mailbox import tag_key
from .session import Session
from .work import Work


class AsyncProcessGroup:
    """A rank of a job. Create with ``init_process_group_async``.

    Each collective is issued when it is called: it returns an ``asyncio.Task`` already
    running on the caller's loop, so collectives go out in call order whether or not (and in
    whatever order) they are awaited; cancelling one fails it on every rank."""

    def __init__(self, settings: ClientSettings, channel: grpc.aio.Channel, session: Session,
                 peer_endpoint: PeerEndpoint | None = None):
        joined = session.joined
        self.settings = settings
        self.rank: int = joined.rank
        self.world_size: int = joined.world_size
        self.generation: int = joined.generation
        self.job: str = joined.job
        self.peers: dict[int, str] = {p.rank: p.address for p in joined.peers}
        self._member_id = joined.member_id
        self._channel = channel
        self._session = session
        self._metadata = call_metadata(settings)
        self._plane = DataPlane(settings, list(joined.shards))
        #: The hub shards this generation's collectives are striped over (empty: none).
        self.shards: list[str] = self._plane.addresses
        self._seq = itertools.count(1)
        #: Numbers this rank's all_to_all calls (their payload's peer tag), in call order.
        self._all_to_all_calls = itertools.count(1)
        self._closed = False
        self._peer_endpoint = peer_endpoint
        #: The two-level all_reduce over this generation's hosts (inactive on one host).
        self._hosts = HostHierarchy(self, {p.rank: p.host for p in joined.peers},
                                    functools.partial(_subgroup, settings))
        if peer_endpoint is not None:
            peer_endpoint.bind(Identity(self.job, self.generation, self.rank, self.world_size,
                                        tuple(joined.peer_keys)), self.peers, session)

    @property
    def shared_memory(self) -> bool:
        """Whether collective payloads move through shared memory with the hub (and its
        shards): True while every one of them still takes this rank's segments, False once one
        refused (another host, user or container: that target gets them on the stream) or
        when ``shared_memory=False`` was set."""
        return all(t.shm.enabled for t in self._plane.targets())

    # -- collectives ---------------------------------------------------------------------------

    def all_reduce(self, x, op: str = "sum", *, timeout: float | None = None,
                   out=None) -> Awaitable:
        """Elementwise ``op`` over every rank's ``x``; resolves to a new array of x's type, or
        to ``out`` holding the result.

        ``out``: a C-contiguous, writable numpy array or CPU tensor of x's shape and dtype
        that receives the result (``out=x`` reduces in place, as torch.distributed does); the
        result then skips a fresh array and a copy. Do not touch ``out`` until the call
        resolved.

        Raises:
            CollectiveError and subclasses: mismatch, timeout, lost rank, payload too large.
            ConfigurationError: unsupported op or dtype, or not an array or a CPU or CUDA
                tensor; an ``out`` that is not a writable, contiguous CPU array or tensor.
            InvalidCollectiveError: ``out`` of another shape or dtype than ``x``.
        """
        arr, restore = to_numpy(x)
        reduce_op = ops.reduce_op(op)
        into = np.empty_like(arr) if out is None else _output_array(out, arr)
        if self._hosts.takes(arr, reduce_op):
            self._check_usable()
            return self._hosts.all_reduce(arr, reduce_op, into, restore if out is None
                                          else (lambda _result: out), timeout)
        return self._run(ops.ALL_REDUCE, arr, arr, into, restore if out is None
                         else (lambda _result: out), timeout, reduce_op=reduce_op)

    def broadcast(self, x, src: int = 0, *, timeout: float | None = None) -> Awaitable:
        """Rank ``src``'s ``x`` on every rank (every rank passes an ``x`` of the same shape)."""
        arr, restore = to_numpy(x)
        if not 0 <= src < self.world_size:
            raise InvalidCollectiveError(
                f"broadcast src={src} is out of range for world_size {self.world_size}"
            )
        out = arr.copy() if self.rank == src else np.empty_like(arr)
        return self._run(ops.BROADCAST, arr, arr, out, restore, timeout, root=src)

    def all_gather(self, x, *, timeout: float | None = None) -> Awaitable:
        """Every rank's ``x``; resolves to a list indexed by rank."""
        arr, restore = to_numpy(x)
        out = np.empty((self.world_size, *arr.shape), dtype=arr.dtype)
        out[self.rank] = arr  # this rank's segment: sent from here, never received

        def split(result: np.ndarray) -> list:
            whole = restore(result)
            return [whole[i] for i in range(self.world_size)]

        return self._run(ops.ALL_GATHER, arr, out, out,
                         copying_to_device(split, copies_to_device(restore)), timeout)

    def reduce_scatter(self, x, op: str = "sum", *, timeout: float | None = None) -> Awaitable:
        """Reduce ``x`` over ranks and keep shard ``rank`` of dim 0 (dim 0 % world_size == 0)."""
        arr, restore = to_numpy(x)
        reduce_op = ops.reduce_op(op)
        if arr.ndim == 0 or arr.shape[0] % self.world_size:
            raise InvalidCollectiveError(
                f"reduce_scatter needs dim 0 divisible by world_size {self.world_size}, "
                f"got shape {arr.shape}"
            )
        out = np.empty((arr.shape[0] // self.world_size, *arr.shape[1:]), dtype=arr.dtype)
        return self._run(ops.REDUCE_SCATTER, arr, arr, out, restore, timeout,
                         reduce_op=reduce_op)

    def all_reduce_coalesced(self, arrays, op: str = "mean", bucket_cap_mb: float = 25, *,
                             timeout: float | None = None) -> Awaitable:
        """Reduce a list of arrays as a few flat per-dtype buckets of at most ``bucket_cap_mb``
        MB, concurrently; resolves to a list of arrays of the original shapes and types.

        See :func:`gradstar.client.coalesced.all_reduce_coalesced` (raises what it raises).
        """
        return all_reduce_coalesced(self, arrays, op, bucket_cap_mb, timeout=timeout)

    def barrier(self, *, timeout: float | None = None) -> Awaitable:
        """Resolves once every rank has reached the barrier."""
        arr = np.empty(0, dtype=np.float32)
        return self._run(ops.BARRIER, arr, None, arr, lambda a: None, timeout)

    def sync_global_model(self, x, *, model: str, rule: str, outer_lr: float = 0.0,
                          outer_momentum: float = 0.0, timeout: float | None = None) -> Awaitable:
        """An averaging round: the primitive under :class:`gradstar.LocalSGD`.

        Every rank sends a flat float32 ``x`` (parameters for ``rule`` "seed" and "average",
        pseudo-gradients for "outer_sgd" and "outer_nesterov"); the hub averages it, applies the
        rule to the job's global model ``model`` and every rank receives the new global
        parameters (see ``gradstar.coordinator.averaging``).

        Raises:
            ConfigurationError: an unknown rule.
            InvalidCollectiveError: not float32, or a size unlike the stored model.
            CollectiveError and subclasses: as for all_reduce.
        """
        arr, restore = to_numpy(x)
        spec = pb.AveragingSpec(model=model, rule=ops.averaging_rule(rule), outer_lr=outer_lr,
                                outer_momentum=outer_momentum)
        if arr.dtype != np.float32:
            raise InvalidCollectiveError(f"averaging rounds carry float32, got {arr.dtype}")
        return self._run(ops.ALL_REDUCE, arr, arr, np.empty_like(arr), restore, timeout,
                         reduce_op=ops.reduce_op("mean"), averaging=spec)

    def all_to_all(self, inputs, *, timeout: float | None = None) -> Awaitable:
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
                          timeout: float | None = None) -> Awaitable:
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
                    timeout: float | None, into: list[np.ndarray] | None = None) -> Awaitable:
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
        header, timeout = self._header(ops.ALL_TO_ALL, encoded, timeout)
        call = next(self._all_to_all_calls)
        return self._issue(header, lambda: self._move(
            self._collect(header, plans, plans, lambda r: r, timeout), call, plan, pieces, kind,
            deliver, timeout, into))

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

    def send(self, x, dst: int, tag=0, *, timeout: float | None = None) -> Awaitable:
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
             timeout: float | None = None) -> Awaitable:
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

    # -- machinery -----------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise ProcessGroupClosedError(
                f"rank {self.rank}'s process group for job {self.job!r} is closed"
            )
        if self._session.failure is not None:
            raise self._session.failure

    def _run(self, op: int, arr: np.ndarray, send: np.ndarray | None, out: np.ndarray, restore,
             timeout: float | None, *, reduce_op: int = 0, root: int = 0,
             averaging: pb.AveragingSpec | None = None) -> Awaitable:
        """Take the collective's seq and issue it now (see
        :mod:`gradstar.client.collective_stream`): ``send`` is cut by the op's input layout,
        ``out`` receives the result and ``restore`` turns it into what the caller gets."""
        header, timeout = self._header(op, arr, timeout, reduce_op, root, averaging)
        return self._issue(header, lambda: self._collect(header, send, out, restore, timeout))

    def _header(self, op: int, arr: np.ndarray, timeout: float | None, reduce_op: int = 0,
                root: int = 0, averaging: pb.AveragingSpec | None = None,
                ) -> tuple[pb.CollectiveHeader, float]:
        """The next collective's header (its seq taken now) and its timeout."""
        self._check_usable()
        timeout = self.settings.timeout if timeout is None else timeout
        header = pb.CollectiveHeader(
            job=self.job, generation=self.generation, group="default", seq=next(self._seq),
            rank=self.rank, member_id=self._member_id, op=op, reduce_op=reduce_op,
            dtype=dtype_info(arr.dtype).wire, shape=arr.shape, root=root,
            chunk_bytes=aligned_chunk_bytes(striped_chunk_bytes(
                self.settings.chunk_bytes, arr.nbytes,
                len(self._plane.targets(averaging=averaging is not None))), arr.dtype.itemsize),
            timeout_seconds=timeout, averaging=averaging,
        )
        return header, timeout

    def _targets(self, header: pb.CollectiveHeader):
        return self._plane.targets(averaging=bool(header.averaging.rule))

    def _issue(self, header: pb.CollectiveHeader, run) -> Awaitable:
        """Start ``run()``, the call that carries collective ``header``, now
        (:func:`~gradstar.client.collective_stream.issue`); cancelled before it ran, it tells
        the hub so that no rank waits for it."""
        return issue(run, lambda: abandon_collective(self._targets(header), header,
                                                     self.world_size, self._metadata))

    async def _collect(self, header: pb.CollectiveHeader, send: np.ndarray | None,
                       out: np.ndarray, restore, timeout: float):
        result = await run_collective(self._targets(header), header, self.world_size, send, out,
                                      session=self._session, metadata=self._metadata,
                                      timeout=timeout)
        return await delivered(restore, result)

    # -- lifecycle -----------------------------------------------------------------------------

    async def close(self) -> None:
        """Leave the job and close the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._hosts.close()
            if self._peer_endpoint is not None:
                # Goodbyes first: a rank receiving from this one then has all it sent before it
                # hears from the hub that this rank finished (gradstar.client.peer.endpoint).
                await self._peer_endpoint.close()
        finally:
            try:
                await self._session.close()
            finally:
                await self._plane.close()
                await self._channel.close()

    async def __aenter__(self) -> AsyncProcessGroup:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def __repr__(self) -> str:
        return (f"AsyncProcessGroup(job={self.job!r}, rank={self.rank}, "
                f"world_size={self.world_size}, generation={self.generation})")


def _output_array(out, like: np.ndarray) -> np.ndarray:
    """``out`` as a numpy array sharing its memory, checked against the input ``like``.

    Raises:
        ConfigurationError: not a writable C-contiguous numpy array or CPU tensor.
        InvalidCollectiveError: another shape or dtype than ``like``.
    """
    arr = None
    if isinstance(out, np.ndarray):
        arr = out
    elif is_cpu_tensor(out) and out.is_contiguous():
        arr, _ = to_numpy(out)  # a view of the tensor's memory
    if arr is None or not (arr.flags.c_contiguous and arr.flags.writeable):
        raise ConfigurationError(
            "out= takes a writable, C-contiguous numpy array or CPU tensor, got "
            f"{type(out).__name__}" + (f" on {out.device}" if hasattr(out, "device") else ""))
    if arr.shape != like.shape or arr.dtype != like.dtype:
        raise InvalidCollectiveError(
            f"out= must match the input: shape {like.shape} and dtype {like.dtype}, got shape "
            f"{arr.shape} and dtype {arr.dtype}")
    return arr


def _settings(**given) -> ClientSettings:
    settings = ClientSettings(**{k: v for k, v in given.items() if v is not None})
    if settings.world_size is None:
        raise ConfigurationError(
            "world_size is required: pass world_size= or set GRADSTAR_WORLD_SIZE"
        )
    if settings.token is None and settings.token_file is not None:
        try:
            token = settings.token_file.read_text(encoding="utf-8").strip()
        except OSError as error:
            raise ConfigurationError(f"cannot read the token file {settings.token_file}: "
                                     f"{error.strerror}") from None
        if not token:  # an empty token would mean "no authentication": never by accident
            raise ConfigurationError(f"the token file {settings.token_file} is empty")
        settings.token = SecretStr(token)
    return settings


async def init_process_group_async(
    coordinator: str | None = None, job: str | None = None, world_size: int | None = None,
    rank: int | None = None, token: str | None = None, *, peer_address: str = "", **options,
) -> AsyncProcessGroup:
    """Join ``job`` on the coordinator and wait for every rank; return the rank's group.

    Arguments left as None come from ``GRADSTAR_COORDINATOR``, ``GRADSTAR_JOB``,
    ``GRADSTAR_WORLD_SIZE``, ``GRADSTAR_RANK`` and ``GRADSTAR_TOKEN``. ``options`` are further
    :class:`~gradstar.config.ClientSettings` fields (``timeout``, ``join_timeout``, ``tls_ca``,
    ``chunk_bytes``, ...). ``rank=None`` lets the coordinator assign one. The rank's peer server
    (send/recv) binds ``peer_host``:``peer_port`` and registers its address in the peer table;
    ``peer_address`` overrides the address registered (NAT, a name the others resolve).

    Raises:
        ConfigurationError: a missing or invalid setting.
        CoordinatorUnavailableError: the coordinator or a hub shard of the generation could
            not be reached within ``connect_timeout`` seconds (a TLS mismatch: at once, named).
        AuthenticationError: the coordinator refused the token.
        RendezvousError and subclasses: duplicate rank, world-size disagreement, join timeout.
    """
    try:
        settings = _settings(coordinator=coordinator, job=job, world_size=world_size, rank=rank,
                             token=token, **options)
    except ValueError as error:
        if isinstance(error, GradstarError):
            raise
        raise ConfigurationError(f"invalid process group settings: {error}") from None
    if settings.tune_allocator:
        tune_allocator()
    group = await _join(settings, peer_address)
    try:
        await group._hosts.start()
    except BaseException:
        await group.close()
        raise
    return group


async def _join(settings: ClientSettings, peer_address: str = "", *,
                peers: bool = True) -> AsyncProcessGroup:
    """Join ``settings.job`` and connect to its data plane (``peers=False``: without a peer
    server, for the per-host groups of :mod:`.hierarchy`)."""
    channel = open_channel(settings)
    peer_endpoint = PeerEndpoint(settings, call_metadata(settings)) if peers else None
    try:
        if peer_endpoint is not None:
            peer_address = await peer_endpoint.start(peer_address)
        await wait_connected(channel, settings.coordinator, settings.connect_timeout,
                             settings.tls_ca, settings.tls_cert, settings.tls_key)
        session = Session(channel, call_metadata(settings), settings.coordinator)
        await session.join(settings.job, settings.world_size, settings.rank,
                           peer_address, settings.join_timeout)
    except BaseException:
        await channel.close()
        if peer_endpoint is not None:
            await peer_endpoint.close()
        raise
    group = AsyncProcessGroup(settings, channel, session, peer_endpoint)
    try:
        await group._plane.connect(settings.connect_timeout)
    except BaseException:
        await group.close()
        raise
    return group


class _LoopThread:
    """An event loop on a daemon thread, for blocking callers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gradstar-loop",
                                        daemon=True)
        self._thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        """Finish what is left on the loop, as ``asyncio.run`` does, then stop and close it.

        Left over after a failed join, for one: grpc's task feeding the session's request
        stream. Closing the loop under it made Python print "Task was destroyed but it is
        pending!" and "Event loop is closed" after the error the user needs to read.
        """
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            self.submit(_finish_tasks()).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


async def _finish_tasks() -> None:
    """Cancel every other task of the running loop, wait for them, and close async generators."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


class ProcessGroup:
    """Blocking process group; each method wraps the :class:`AsyncProcessGroup` method.

    ``async_op=True`` returns a :class:`Work` instead of blocking, as in torch.distributed.
    """

    def __init__(self, group: AsyncProcessGroup, runner: _LoopThread) -> None:
        self._group = group
        self._runner = runner

    rank = property(lambda self: self._group.rank)
    world_size = property(lambda self: self._group.world_size)
    generation = property(lambda self: self._group.generation)
    job = property(lambda self: self._group.job)
    peers = property(lambda self: self._group.peers)
    shards = property(lambda self: self._group.shards)
    shared_memory = property(lambda self: self._group.shared_memory)

    def _call(self, awaitable, async_op: bool):
        future = self._runner.submit(awaitable)
        return Work(future) if async_op else Work(future).wait()

    def all_reduce(self, x, op: str = "sum", *, async_op: bool = False, timeout=None,
                   out=None):
        return self._call(self._group.all_reduce(x, op, timeout=timeout, out=out), async_op)

    def broadcast(self, x, src: int = 0, *, async_op: bool = False, timeout=None):
        return self._call(self._group.broadcast(x, src, timeout=timeout), async_op)

    def all_gather(self, x, *, async_op: bool = False, timeout=None):
        return self._call(self._group.all_gather(x, timeout=timeout), async_op)

    def reduce_scatter(self, x, op: str = "sum", *, async_op: bool = False, timeout=None):
        return self._call(self._group.reduce_scatter(x, op, timeout=timeout), async_op)

    def all_reduce_coalesced(self, arrays, op: str = "mean", bucket_cap_mb: float = 25, *,
                             async_op: bool = False, timeout=None):
        return self._call(self._group.all_reduce_coalesced(arrays, op, bucket_cap_mb,
                                                           timeout=timeout), async_op)

    def barrier(self, *, async_op: bool = False, timeout=None):
        return self._call(self._group.barrier(timeout=timeout), async_op)

    def sync_global_model(self, x, *, model: str, rule: str, outer_lr: float = 0.0,
                          outer_momentum: float = 0.0, async_op: bool = False, timeout=None):
        return self._call(self._group.sync_global_model(
            x, model=model, rule=rule, outer_lr=outer_lr, outer_momentum=outer_momentum,
            timeout=timeout), async_op)

    def send(self, x, dst: int, tag=0, *, async_op: bool = False, timeout=None):
        return self._call(self._group.send(x, dst, tag, timeout=timeout), async_op)

    def recv(self, src: int | None = None, tag=0, *, async_op: bool = False, timeout=None):
        return self._call(self._group.recv(src, tag, timeout=timeout), async_op)

    def all_to_all(self, inputs, *, async_op: bool = False, timeout=None):
        return self._call(self._group.all_to_all(inputs, timeout=timeout), async_op)

    def all_to_all_single(self, x, output_split_sizes=None, input_split_sizes=None, *,
                          async_op: bool = False, timeout=None):
        return self._call(self._group.all_to_all_single(
            x, output_split_sizes, input_split_sizes, timeout=timeout), async_op)

    def close(self) -> None:
        """Leave the job, close the connection and stop the loop thread. Idempotent."""
        if self._runner is None:
            return
        try:
            self._runner.submit(self._group.close()).result(timeout=15)
        finally:
            self._runner.stop()
            self._runner = None

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return repr(self._group).replace("AsyncProcessGroup", "ProcessGroup", 1)


def init_process_group(
    coordinator: str | None = None, job: str | None = None, world_size: int | None = None,
    rank: int | None = None, token: str | None = None, **options,
) -> ProcessGroup:
    """Blocking form of :func:`init_process_group_async`; same arguments, same errors."""
    runner = _LoopThread()
    try:
        group = runner.submit(init_process_group_async(
            coordinator, job, world_size, rank, token, **options)).result()
    except BaseException:
        runner.stop()
        raise
    return ProcessGroup(group, runner)


async def _subgroup(settings: ClientSettings, job: str, world_size: int,
                    rank: int) -> AsyncProcessGroup:
    """Join ``job``, one of the groups of :mod:`.hierarchy`, as this rank's main settings
    say (coordinator, token, TLS, timeouts), without a peer server: it runs collectives only."""
    return await _join(settings.model_copy(update={"job": job, "world_size": world_size,
                                                   "rank": rank}), peers=False)


__all__ = [
    "AsyncProcessGroup",
    "ProcessGroup",
    "init_process_group",
    "init_process_group_async",
]
