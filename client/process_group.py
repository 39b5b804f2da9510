"""Process groups: the rank's handle on its job. ``AsyncProcessGroup`` does the work;
``ProcessGroup`` runs it on a private event-loop thread for blocking code.

Every collective takes its sequence number when it is *called*, not when it is awaited, so
collectives issued in the same order on every rank match on the hub even when several run
concurrently (``async_op=True`` or ``asyncio.gather``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from collections.abc import Awaitable

import grpc
import numpy as np

from gradstar import ops
from gradstar.allocator import tune_allocator
from gradstar.config import ClientSettings
from gradstar.errors import (
    ConfigurationError,
    GradstarError,
    InvalidCollectiveError,
    ProcessGroupClosedError,
)
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.transport.channels import call_metadata, open_channel
from gradstar.transport.tls_check import wait_connected
from gradstar.wire import aligned_chunk_bytes, dtype_info

from .coalesced import all_reduce_coalesced
from .collective_stream import run_collective
from .convert import array_kind, restore_array, to_numpy
from .data_plane import DataPlane
from .peer import Identity, PeerEndpoint
from .peer.mailbox import tag_key
from .session import Session
from .work import Work


class AsyncProcessGroup:
    """A rank of a job; collectives are awaitables. Create with ``init_process_group_async``."""

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
        self._plane = DataPlane(settings, channel, list(joined.shards))
        #: The hub shards this generation's collectives are striped over (empty: none).
        self.shards: list[str] = self._plane.addresses
        self._seq = itertools.count(1)
        self._closed = False
        self._peer_endpoint = peer_endpoint
        if peer_endpoint is not None:
            peer_endpoint.bind(Identity(self.job, self.generation, self.rank, self.world_size,
                                        joined.peer_key), self.peers, session)

    # -- collectives ---------------------------------------------------------------------------

    def all_reduce(self, x, op: str = "sum", *, timeout: float | None = None) -> Awaitable:
        """Elementwise ``op`` over every rank's ``x``; resolves to a new array of x's type.

        Raises:
            CollectiveError and subclasses: mismatch, timeout, lost rank, payload too large.
            ConfigurationError: unsupported op or dtype, or not an array or CPU tensor.
        """
        arr, restore = to_numpy(x)
        reduce_op = ops.reduce_op(op)
        return self._run(ops.ALL_REDUCE, arr, arr, np.empty_like(arr), restore, timeout,
                         reduce_op=reduce_op)

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

        return self._run(ops.ALL_GATHER, arr, out, out, split, timeout)

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

    def recv(self, src: int, tag=0, *, timeout: float | None = None) -> Awaitable:
        """The next message from rank ``src`` with ``tag``, as the type it was sent as (numpy
        array, or torch tensor where torch is installed), with its shape and dtype.

        A message that already arrived is returned even if the generation failed since.

        Raises:
            ConfigurationError: bad ``src`` or tag.
            RankLostError: ``src`` (or another rank of the generation) was lost.
            CollectiveTimeoutError: no such message arrived within ``timeout``.
        """
        src, key = self._peer_check(src, "receive from"), tag_key(tag)
        if self._closed:  # (a failed generation is checked later: see above)
            self._check_usable()
        timeout = self.settings.timeout if timeout is None else timeout
        peers = self._peer_endpoint

        async def receive():
            return restore_array(*await peers.recv(src, key, timeout))

        return receive()

    def _peer_check(self, peer: int, what: str) -> int:
        if self._peer_endpoint is None:
            raise ConfigurationError("this process group has no peer endpoint for send/recv")
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
        """Take the collective's seq now and return the coroutine that runs it (see
        :mod:`gradstar.client.collective_stream`): ``send`` is cut by the op's input layout,
        ``out`` receives the result and ``restore`` turns it into what the caller gets."""
        self._check_usable()
        timeout = self.settings.timeout if timeout is None else timeout
        header = pb.CollectiveHeader(
            job=self.job, generation=self.generation, group="default", seq=next(self._seq),
            rank=self.rank, member_id=self._member_id, op=op, reduce_op=reduce_op,
            dtype=dtype_info(arr.dtype).wire, shape=arr.shape, root=root,
            chunk_bytes=aligned_chunk_bytes(self.settings.chunk_bytes, arr.dtype.itemsize),
            timeout_seconds=timeout, averaging=averaging,
        )
        return self._collect(header, send, out, restore, timeout)

    async def _collect(self, header: pb.CollectiveHeader, send: np.ndarray | None,
                       out: np.ndarray, restore, timeout: float):
        targets = self._plane.targets(averaging=bool(header.averaging.rule))
        result = await run_collective(targets, header, self.world_size, send, out,
                                      session=self._session, metadata=self._metadata,
                                      timeout=timeout)
        return restore(result)

    # -- lifecycle -----------------------------------------------------------------------------

    async def close(self) -> None:
        """Leave the job and close the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._session.close()
        finally:
            await self._plane.close()
            await self._channel.close()
            if self._peer_endpoint is not None:
                await self._peer_endpoint.close()

    async def __aenter__(self) -> AsyncProcessGroup:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def __repr__(self) -> str:
        return (f"AsyncProcessGroup(job={self.job!r}, rank={self.rank}, "
                f"world_size={self.world_size}, generation={self.generation})")


def _settings(**given) -> ClientSettings:
    settings = ClientSettings(**{k: v for k, v in given.items() if v is not None})
    if settings.world_size is None:
        raise ConfigurationError(
            "world_size is required: pass world_size= or set GRADSTAR_WORLD_SIZE"
        )
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
        CoordinatorUnavailableError: the coordinator could not be reached within
            ``connect_timeout`` seconds.
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
    channel = open_channel(settings)
    peer_endpoint = PeerEndpoint(settings, call_metadata(settings))
    try:
        peer_address = await peer_endpoint.start(peer_address)
        await wait_connected(channel, settings.coordinator, settings.connect_timeout,
                             settings.tls_ca, settings.tls_cert, settings.tls_key)
        session = Session(channel, call_metadata(settings), settings.coordinator)
        await session.join(settings.job, settings.world_size, settings.rank,
                           peer_address, settings.join_timeout)
    except BaseException:
        await channel.close()
        await peer_endpoint.close()
        raise
    return AsyncProcessGroup(settings, channel, session, peer_endpoint)


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
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


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

    def _call(self, awaitable, async_op: bool):
        future = self._runner.submit(awaitable)
        return Work(future) if async_op else Work(future).wait()

    def all_reduce(self, x, op: str = "sum", *, async_op: bool = False, timeout=None):
        return self._call(self._group.all_reduce(x, op, timeout=timeout), async_op)

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

    def recv(self, src: int, tag=0, *, async_op: bool = False, timeout=None):
        return self._call(self._group.recv(src, tag, timeout=timeout), async_op)

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


__all__ = [
    "AsyncProcessGroup",
    "ProcessGroup",
    "init_process_group",
    "init_process_group_async",
]
