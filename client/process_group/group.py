"""The asyncio process group: :class:`AsyncProcessGroup`, a rank's collectives over the hub
(or its shards) and its life cycle, from :func:`~.join.open_group` (join, connect) to ``close``.
It owns what has a seam of its own and delegates to it: its point-to-point calls
(:class:`~.point_to_point.PeerCalls`), its ride through coordinator restarts
(:class:`~.ride.Rider`), the two-level collectives across hosts, the data plane and the
direct lane.

Every collective takes its sequence number when it is *called*, not when it is awaited, so
collectives issued in the same order on every rank match on the hub even when several run
concurrently (``async_op=True`` or ``asyncio.gather``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass

import grpc
import numpy as np

from gradstar import ops
from gradstar.config import ClientSettings
from gradstar.errors import InvalidCollectiveError, ProcessGroupClosedError
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.proto.v1 import rendezvous_pb2 as rpb
from gradstar.transport.channels import call_metadata, open_blocking_channel
from gradstar.wire import COLLECTIVE_METHOD, aligned_chunk_bytes, dtype_info, numpy_dtype_name
from gradstar.wire.encoded import aligned_wire_chunk_bytes
from gradstar.wire.formats import WireFormat

from ..coalesced import all_reduce_coalesced
from ..collective.data_plane import DataPlane, striped_chunk_bytes
from ..collective.direct import DirectLane, SettledCall
from ..collective.reissue import Seqs
from ..collective.stream import abandon_collective, give_up, issue, run_collective
from ..convert import copies_to_device, copying_to_device, delivered, output_array, to_numpy
from ..hierarchy import HostHierarchy
from ..peer import Identity, PeerEndpoint
from ..session import Session
from ..stragglers import StragglerLog, StragglerStats, fetch_stragglers
from .parts import split_all_reduce
from .point_to_point import PeerCalls
from .protocol import ArrayLike, Result
from .ride import Rider, RidingLane


@dataclass(frozen=True)
class Reserved:
    """A collective whose seq was taken by :meth:`AsyncProcessGroup.reserve`, not yet issued."""

    call: ops.CollectiveCall
    timeout: float

    @property
    def header(self) -> pb.CollectiveHeader:
        return self.call.header


class AsyncProcessGroup:
    """A rank of a job. Create with ``init_process_group_async``.

    Each collective is issued when it is called: it returns an ``asyncio.Task`` already
    running on the caller's loop, so collectives go out in call order whether or not (and in
    whatever order) they are awaited; cancelling one fails it on every rank."""

    def __init__(self, settings: ClientSettings, channel: grpc.aio.Channel, session: Session,
                 peer_endpoint: PeerEndpoint | None = None, subgroup=None):
        joined = session.joined
        self.settings = settings
        self.rank: int = joined.rank
        self.world_size: int = joined.world_size
        self.generation: int = joined.generation
        self.job: str = joined.job
        #: This rank took a lost rank's place in a running generation (an elastic join).
        self.replacement: bool = joined.replacement
        #: The coordinator's answer to the join (sizes, a resize's boundary and newcomers).
        self.joined = joined
        #: Where the rank is in the job's step boundaries (:mod:`.membership`), or None; and
        #: the peer address it asked to register (what a move registers again).
        self.membership = session.membership
        self.peer_address_given = ""
        self.peers: dict[int, str] = {p.rank: p.address for p in joined.peers}
        #: The rendezvous' id of this member: with job, generation and rank, what binds its calls.
        self.member_id: str = joined.member_id
        self._channel = channel
        self._session = session
        session.stragglers = StragglerLog.for_group(settings, joined)
        self._metadata = call_metadata(settings)
        self._plane = DataPlane.joined(settings, joined, self._metadata)
        #: The hub shards this generation's collectives are striped over (empty: none).
        self.shards: list[str] = self._plane.addresses
        self._seq = Seqs()
        self._calls = ops.CallCache()  # the calls this rank issued, derived once per kind
        #: The blocking API's lane for small collectives from its caller's thread (None: every
        #: collective runs on the loop): :meth:`open_direct_lane`.
        self.direct: DirectLane | None = None
        self._submit: Callable[[Coroutine], object] | None = None  # the direct lane's
        self._closed = False
        self._peer_endpoint = peer_endpoint
        self._peer_calls = PeerCalls(self.rank, self.world_size, self.peers, peer_endpoint,
                                     settings.timeout, check_usable=self._check_usable,
                                     check_open=self._check_open, exchange=self._exchange_plans)
        #: The two-level collectives over this generation's hosts (inactive on one host);
        #: ``subgroup(job, world_size, rank)`` joins one of them (join.open_group's).
        self._hosts = HostHierarchy(self, {p.rank: p.host for p in joined.peers}, subgroup)
        if peer_endpoint is not None:
            peer_endpoint.bind(Identity(self.job, self.generation, self.rank, self.world_size,
                                        tuple(joined.peer_keys)), joined, session)
        #: Holds this group's collectives for issuing again, if its session rides through
        #: restarts (``reconnect_timeout`` above 0); else None.
        self._rider: Rider | None = None
        if session.ride is not None:
            self._rider = Rider(self._seq, session.ride, self._attempt)
            session.ride.claim = lambda: self._rider.claim(self._session.joined)
            session.ride.on_rejoined.append(self._rejoined)

    @property
    def collective_address(self) -> str:
        """Where this rank reaches the coordinator's collective port (tensors ride there)."""
        return self._plane.collectives

    @property
    def shared_memory(self) -> bool:
        """Whether collective payloads move through shared memory with the hub (and its
        shards): True while every one of them still takes this rank's segments, False once one
        refused (another host, user or container: that target gets them on the stream) or
        when ``shared_memory=False`` was set."""
        return all(t.shm.enabled for t in self._plane.targets())

    @property
    def peer_bytes(self) -> tuple[int, int]:
        """(sent, received) payload bytes over peer streams: send/recv, all_to_all, Pipeline."""
        e = self._peer_endpoint
        return (0, 0) if e is None else (e.bytes_sent, e.bytes_received)

    @property
    def peer_routes(self) -> dict[int, str]:
        """How this rank's peer streams reach each rank it sent to: "direct", "punched" (NAT
        traversal to an outbound-only host) or "relayed" (through the coordinator)."""
        return {} if self._peer_endpoint is None else dict(self._peer_endpoint.routes_to)

    @property
    def session(self) -> Session:
        """The rank's session with the rendezvous (its verdicts, what it tells the hub)."""
        return self._session

    @property
    def reconnects(self) -> list[float]:
        """How long each ride through a coordinator restart lasted (seconds), oldest first."""
        return [] if self._rider is None else self._rider.waits

    # -- collectives ---------------------------------------------------------------------------

    def all_reduce(self, x, op: str = "sum", *, timeout: float | None = None,
                   out=None, wire: str | None = None) -> Awaitable[ArrayLike]:
        """Elementwise ``op`` over every rank's ``x``; resolves to a new array of x's type, or
        to ``out`` holding the result.

        ``wire``: a compressed wire format (``"bf16"``, ``"fp16"``, ``"int8"``, ``"int4"``; see
        :mod:`gradstar.wire.formats`) for a float ``x``: every rank's chunks travel encoded, the
        hub reduces them in float32 and encodes the result once; every rank gets the same
        result, within the format's documented error. With the two-level all_reduce only the
        leaders' stage across hosts is encoded. Every rank must pass the same ``wire``.

        ``out``: a C-contiguous, writable numpy array or CPU tensor of x's shape and dtype
        that receives the result (``out=x`` reduces in place, as torch.distributed does); the
        result then skips a fresh array and a copy. Do not touch ``out`` until the call
        resolved.

        Raises:
            CollectiveError and subclasses: mismatch, timeout, lost rank, payload too large.
            ConfigurationError: unsupported op or dtype, or not an array or a CPU or CUDA
                tensor; an ``out`` that is not a writable, contiguous CPU array or tensor; a
                ``wire`` format that is unknown, on a non-float dtype, or (8- and 4-bit) with
                ``op='prod'`` — raised before anything is sent.
            InvalidCollectiveError: ``out`` of another shape or dtype than ``x``.
        """
        arr, restore = to_numpy(x)
        reduce_op = ops.reduce_op(op)
        fmt = self._check(ops.ALL_REDUCE, arr, reduce_op=reduce_op, wire=wire)
        into = np.empty_like(arr) if out is None else output_array(out, arr)
        if self._hosts.takes(ops.ALL_REDUCE, arr, reduce_op):
            self._check_usable()
            return self._hosts.all_reduce(arr, reduce_op, into, restore if out is None
                                          else (lambda _result: out), timeout, wire)
        deliver = restore if out is None else (lambda _result: out)
        return split_all_reduce(self, arr, reduce_op, into, deliver, timeout, wire) or self._run(
            ops.ALL_REDUCE, arr, arr, into, deliver, timeout, reduce_op=reduce_op, fmt=fmt)

    def broadcast(self, x, src: int = 0, *,
                  timeout: float | None = None) -> Awaitable[ArrayLike]:
        """Rank ``src``'s ``x`` on every rank (every rank passes an ``x`` of the same shape)."""
        arr, restore = to_numpy(x)
        self._check(ops.BROADCAST, arr, root=src)
        if self._hosts.takes(ops.BROADCAST, arr):
            self._check_usable()
            return self._hosts.broadcast(arr, src, restore, timeout)
        out = arr.copy() if self.rank == src else np.empty_like(arr)
        return self._run(ops.BROADCAST, arr, arr, out, restore, timeout, root=src)

    def all_gather(self, x, *, timeout: float | None = None) -> Awaitable[list[ArrayLike]]:
        """Every rank's ``x``; resolves to a list indexed by rank."""
        arr, restore = to_numpy(x)

        def split(result: np.ndarray) -> list:
            whole = restore(result)
            return [whole[i] for i in range(self.world_size)]

        deliver = copying_to_device(split, copies_to_device(restore))
        if self._hosts.takes(ops.ALL_GATHER, arr):
            self._check_usable()
            return self._hosts.all_gather(arr, deliver, timeout)
        out = np.empty((self.world_size, *arr.shape), dtype=arr.dtype)
        out[self.rank] = arr  # this rank's segment: sent from here, never received
        return self._run(ops.ALL_GATHER, arr, out, out, deliver, timeout)

    def reduce_scatter(self, x, op: str = "sum", *, timeout: float | None = None,
                       wire: str | None = None) -> Awaitable[ArrayLike]:
        """Reduce ``x`` over ranks and keep shard ``rank`` of dim 0 (dim 0 % world_size == 0);
        ``wire`` as for :meth:`all_reduce`.

        Raises:
            What :meth:`all_reduce` raises; InvalidCollectiveError: dim 0 not divisible.
        """
        arr, restore = to_numpy(x)
        reduce_op = ops.reduce_op(op)
        fmt = self._check(ops.REDUCE_SCATTER, arr, reduce_op=reduce_op, wire=wire)
        if self._hosts.takes(ops.REDUCE_SCATTER, arr, reduce_op):
            self._check_usable()
            return self._hosts.reduce_scatter(arr, reduce_op, restore, timeout, wire)
        out = np.empty((arr.shape[0] // self.world_size, *arr.shape[1:]), dtype=arr.dtype)
        return self._run(ops.REDUCE_SCATTER, arr, arr, out, restore, timeout,
                         reduce_op=reduce_op, fmt=fmt)

    def all_reduce_coalesced(self, arrays, op: str = "mean", bucket_cap_mb: float = 25, *,
                             timeout: float | None = None,
                             wire: str | None = None) -> Awaitable[list]:
        """Reduce a list of arrays as a few flat per-dtype buckets of at most ``bucket_cap_mb``
        MB, concurrently; resolves to a list of arrays of the original shapes and types
        (``wire``: a format for the float buckets).

        See :func:`gradstar.client.coalesced.all_reduce_coalesced` (raises what it raises).
        """
        return all_reduce_coalesced(self, arrays, op, bucket_cap_mb, timeout=timeout,
                                    wire=wire)

    def barrier(self, *, timeout: float | None = None) -> Awaitable[None]:
        """Resolves once every rank has reached the barrier."""
        arr = np.empty(0, dtype=np.float32)
        return self._run(ops.BARRIER, arr, None, arr, lambda a: None, timeout)

    def sync_global_model(self, x, *, model: str, rule: str, outer_lr: float = 0.0,
                          outer_momentum: float = 0.0, timeout: float | None = None,
                          wire: str | None = None) -> Awaitable[ArrayLike]:
        """An averaging round: the primitive under :class:`gradstar.LocalSGD`.

        Every rank sends a flat float32 ``x`` (parameters for ``rule`` "seed" and "average",
        pseudo-gradients for "outer_sgd" and "outer_nesterov"); the hub averages it, applies the
        rule to the job's global model ``model`` and every rank receives the new global
        parameters (see ``gradstar.coordinator.rounds.averaging``).

        ``wire``: a compressed wire format for what the ranks send (meant for the
        pseudo-gradients of "outer_sgd" and "outer_nesterov"); the hub decodes it, keeps the
        global model and the outer optimizer in float32, and answers float32 parameters.

        Raises:
            ConfigurationError: an unknown rule or wire format.
            InvalidCollectiveError: not float32, or a size unlike the stored model.
            CollectiveError and subclasses: as for all_reduce.
        """
        arr, restore = to_numpy(x)
        spec = pb.AveragingSpec(model=model, rule=ops.averaging_rule(rule), outer_lr=outer_lr,
                                outer_momentum=outer_momentum)
        if arr.dtype != np.float32:
            raise InvalidCollectiveError(f"averaging rounds carry float32, got {arr.dtype}")
        mean = ops.reduce_op("mean")
        fmt = self._check(ops.ALL_REDUCE, arr, reduce_op=mean, wire=wire)
        return self._run(ops.ALL_REDUCE, arr, arr, np.empty_like(arr), restore, timeout,
                         reduce_op=mean, averaging=spec, fmt=fmt)

    # -- over peer streams (:class:`~.point_to_point.PeerCalls`) --------------------------------

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
        return self._peer_calls.send(x, dst, tag, timeout=timeout)

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
        return self._peer_calls.recv(src, tag, timeout=timeout)

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
        return self._peer_calls.all_to_all(inputs, timeout=timeout)

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
        return self._peer_calls.all_to_all_single(x, output_split_sizes, input_split_sizes,
                                                  timeout=timeout)

    async def straggler_stats(self, *, limit: int = 0,
                              timeout: float = 10.0) -> StragglerStats:
        """The job's arrival summary from the coordinator: per rank (slowest first, at most
        ``limit``; 0: all) its lag behind the first rank at the job's collectives, wherever
        they ran (the coordinator, its hub shards), how often the others waited for it and
        for how long.

        Raises:
            CoordinatorUnavailableError, AuthenticationError, GradstarError: the call failed.
        """
        return await fetch_stragglers(self._channel, self._metadata, self.job, limit=limit,
                                      timeout=timeout, target=self.settings.coordinator)

    # -- collectives issued later, in the order they were reserved ------------------------------

    def reserve(self, op: int, like: np.ndarray, *, reduce_op: int = 0, root: int = 0,
                timeout: float | None = None, wire: str | None = None, part_of: int = 0,
                ) -> Reserved:
        """Take the next seq now for collective ``op`` over arrays of ``like``'s shape and dtype
        (this rank's input), to issue later with :meth:`run_reserved` or never, saying so
        with :meth:`give_up`. The hub matches collectives by seq, so collectives reserved in
        the same order on every rank pair up whatever order they are issued in: the stages of
        :mod:`gradstar.client.hierarchy` need exactly that.

        Raises:
            ProcessGroupClosedError: the group is closed.
            GradstarError: the group's generation failed (its failure).
        """
        fmt = ops.check_encoding(wire, like.dtype, op, reduce_op)
        return Reserved(*self._call(op, like, timeout, reduce_op, root, fmt=fmt, whole=part_of))

    def run_reserved(self, reserved: Reserved, send: np.ndarray,
                     out: np.ndarray) -> Awaitable[np.ndarray]:
        """Issue ``reserved`` now, sending from ``send`` (cut by the op's input layout);
        resolves to the result array (``out``). Call it on the loop.

        Raises:
            CollectiveError and subclasses: as the collective's own method raises.
        """
        call = reserved.call
        return self._issue(call, lambda: self._collect(call, send, out, _as_is,
                                                       reserved.timeout))

    def give_up(self, reserved: Reserved) -> None:
        """Tell the hub this rank will never issue ``reserved``, so that the ranks that do fail
        it at once rather than at its timeout. Call it on the loop."""
        give_up(self._targets(reserved.call), reserved.call, self._metadata)

    # -- machinery -----------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise ProcessGroupClosedError(
                f"rank {self.rank}'s process group for job {self.job!r} is closed"
            )
        if self._session.failure is not None:
            raise self._session.failure

    def _check_open(self) -> None:
        if self._closed:
            self._check_usable()

    def _check(self, op: int, arr: np.ndarray, *, reduce_op: int = 0, root: int = 0,
               wire: str | None = None) -> WireFormat | None:
        """Check a call before anything is sent, once: the header is built from what this
        returns. The sentences are the op records' (:mod:`gradstar.ops`), as on the hub.

        Raises:
            ConfigurationError: a ``wire`` format :func:`gradstar.ops.check_encoding` refuses.
            InvalidCollectiveError: a precondition of the op's record does not hold.
        """
        fmt = ops.check_encoding(wire, arr.dtype, op, reduce_op)
        ops.check_preconditions(op, ops.Facts(arr.shape, numpy_dtype_name(arr.dtype),
                                              self.world_size, root, self.rank))
        return fmt

    def _run(self, op: int, arr: np.ndarray, send: np.ndarray | None, out: np.ndarray,
             restore: Callable[[np.ndarray], Result], timeout: float | None, *, reduce_op: int = 0,
             root: int = 0, averaging: pb.AveragingSpec | None = None,
             fmt: WireFormat | None = None) -> Awaitable[Result]:
        """Take the collective's seq and issue it now (see
        :mod:`gradstar.client.collective.stream`): ``send`` is cut by the op's input layout,
        ``out`` receives the result and ``restore`` turns it into what the caller gets."""
        call, timeout = self._call(op, arr, timeout, reduce_op, root, averaging, fmt)
        return self._start(call, send, out, restore, timeout)

    def _call(self, op: int, arr: np.ndarray, timeout: float | None, reduce_op: int = 0,
              root: int = 0, averaging: pb.AveragingSpec | None = None,
              fmt: WireFormat | None = None, whole: int = 0) -> tuple[ops.CollectiveCall, float]:
        """The next collective (its seq taken now, after every check that can fail; ``fmt``
        checked; chunks as for ``whole`` bytes), derived once from its header, and its timeout."""
        self._check_usable()
        timeout = self.settings.timeout if timeout is None else timeout
        dtype, wire = dtype_info(arr.dtype).wire, fmt.wire if fmt else 0
        chunk_bytes = aligned_wire_chunk_bytes(aligned_chunk_bytes(striped_chunk_bytes(
            self.settings.chunk_bytes, whole or arr.nbytes,
            len(self._plane.targets(averaging=averaging is not None))),
            arr.dtype.itemsize), arr.dtype.itemsize, fmt)
        header = pb.CollectiveHeader(
            job=self.job, generation=self.generation, group="default", seq=next(self._seq),
            rank=self.rank, member_id=self.member_id, op=op, reduce_op=reduce_op,
            dtype=dtype, shape=arr.shape, root=root, chunk_bytes=chunk_bytes,
            timeout_seconds=timeout, averaging=averaging, wire=wire,
        )
        # The calls of this rank differ in these alone (rank and world size are the group's;
        # no header here offers a segment yet); an averaging round is told apart by its
        # header's fields.
        key = None if averaging is not None else (op, reduce_op, dtype, arr.shape, root,
                                                  chunk_bytes, wire)
        return self._calls.call(header, self.world_size, key), timeout

    def _targets(self, call: ops.CollectiveCall):
        return self._plane.targets(averaging=bool(call.header.averaging.rule))

    def _exchange_plans(self, encoded: np.ndarray, timeout: float,
                        then: Callable[[Awaitable[np.ndarray], float], Coroutine]) -> Awaitable:
        """An all_to_all's plan exchange (:data:`~.point_to_point.PlanExchange`): a hub
        collective gathering every rank's ``encoded`` plan, its seq taken now; the issued
        call runs ``then(plans, timeout)``."""
        plans = np.empty((self.world_size, encoded.size), dtype=np.int64)
        plans[self.rank] = encoded  # this rank's segment: sent from here, never received
        call, timeout = self._call(ops.ALL_TO_ALL, encoded, timeout)
        return self._issue(call, lambda: then(self._collect(call, plans, plans, _as_is,
                                                            timeout), timeout))

    def _issue(self, call: ops.CollectiveCall, run: Callable[[], Coroutine]) -> Awaitable:
        """Start ``run()``, the call that carries collective ``call``, now
        (:func:`~gradstar.client.collective.stream.issue`); cancelled before it ran, it tells
        the hub so that no rank waits for it."""
        return issue(run, lambda: abandon_collective(self._targets(call), call, self._metadata))

    def _start(self, call: ops.CollectiveCall, send: np.ndarray | None, out: np.ndarray,
               restore: Callable[[np.ndarray], Result], timeout: float) -> Awaitable[Result]:
        """Issue ``call`` (:meth:`_issue`), or, on a blocking caller's thread (no running loop)
        when the caller's :attr:`direct` lane takes it, return it as a :class:`SettledCall`
        that thread may run itself."""
        def started() -> Awaitable[Result]:
            return self._issue(call, lambda: self._collect(call, send, out, restore, timeout))

        if self.direct is not None and self.direct.takes(call) and (
                asyncio._get_running_loop() is None):
            return SettledCall(self._lane(), call, send, out, restore, timeout, started)
        return started()

    async def _collect(self, call: ops.CollectiveCall, send: np.ndarray | None,
                       out: np.ndarray, restore, timeout: float):
        """Run ``call`` (in its wire format, if any: ``send`` encoded chunk by chunk as it is
        sent, the result decoded into ``out`` once it is proven complete, so a failure leaves
        ``out`` untouched) and hand ``restore`` the result."""
        if self._rider is not None:  # held, and issued again after a restart
            result = await self._rider.run(call, send, out, timeout)
        else:
            result = await self._attempt(call, timeout)(send, out)
        return await delivered(restore, result)

    def _attempt(self, call: ops.CollectiveCall, timeout: float):
        """Run ``call`` once over the data plane as it is when the attempt starts."""
        def attempt(send: np.ndarray | None, out: np.ndarray):
            return run_collective(self._targets(call), call, send, out, session=self._session,
                                  metadata=self._metadata, timeout=timeout)
        return attempt

    def _lane(self) -> DirectLane | RidingLane | None:
        """The direct lane, wrapped so that its collectives are held too when riding."""
        if self.direct is None or self._rider is None:
            return self.direct
        return RidingLane(self._rider, self.direct, self._submit)

    def _rejoined(self, joined: rpb.Joined) -> None:
        """The session rejoined: a new data plane (and direct lane) for the coordinator that
        answered, and the collectives it names issued again."""
        self.joined = joined
        # The coordinator that took the rank back may be another (under --ha, the new leader).
        self.settings = self.settings.model_copy(update={"coordinator": self._session.target})
        self._channel = self._session.channel
        old, self._plane = self._plane, DataPlane.joined(self.settings, joined, self._metadata)
        self.shards = self._plane.addresses
        self._rider.keep(old.close())
        if self.direct is not None and self._submit is not None:
            self.direct.close()
            watch = self.open_direct_lane(self._submit)
            if watch is not None:
                self._rider.keep(watch)
        self._rider.replay(joined)

    def open_direct_lane(self, submit) -> Coroutine | None:
        """Give a blocking caller's thread its own lane to the hub for small collectives
        (:class:`~gradstar.client.collective.direct.DirectLane`; ``submit`` runs a coroutine
        on this group's loop); returns the lane's watch, to run on the loop (None: no lane,
        as behind hub shards, whose stripes stay on the loop)."""
        if self._plane.shards:
            return None
        self._submit, address = submit, self._plane.collectives
        self.direct = DirectLane(
            open_blocking_channel(self.settings, address), COLLECTIVE_METHOD, address,
            self._metadata, session=self._session, submit=submit,
            abandon=lambda call: abandon_collective(self._targets(call), call, self._metadata))
        return self.direct.watch()

    # -- lifecycle -----------------------------------------------------------------------------

    async def connect(self, *, hosts: bool = True) -> None:
        """Connect to the data plane (hub shards, the collective port) and, with ``hosts``,
        join the groups of the two-level all_reduce; raises what fails on the way. A
        replacement joins a generation whose collectives are over (a lost rank's place, or one
        past the world size): it joins no host group, which its host's other ranks formed
        without it, and its collectives fail with the generation's error as every rank's do."""
        await self._plane.connect(self.settings.connect_timeout, self.world_size)
        if hosts and not self.replacement:
            await self._hosts.start()

    async def close(self) -> None:
        """Leave the job and close the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.direct is not None:
            self.direct.close()
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


def _as_is(result: np.ndarray) -> np.ndarray:
    return result


__all__ = ["AsyncProcessGroup", "Reserved"]
