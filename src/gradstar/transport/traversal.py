"""NAT traversal: a TCP connection between two hosts that take no inbound connections.

A host behind NAT (or a firewall that only lets connections out) drops every SYN that is not
an answer to one it sent. Two such hosts still reach each other when both dial at once (TCP's
*simultaneous open*, as in "hole punching"): each end's SYN opens its own NAT's way for the
other's, and the two SYNs meet. The coordinator, which both reach, tells each end the other's
address; neither needs an open port.

The order that makes it work in one round trip, whatever the timing:

1. the rank binds a port and sends its SYN towards the shard's punch port (:func:`punch`): the
   shard's NAT drops it, but the rank's own NAT now expects an answer from there;
2. it asks the coordinator (``PeerRelay/Punch``) to have the shard dial it back; the shard
   dials from its punch port (:func:`punch`), and its SYN passes the rank's NAT as an answer;
3. the two ends meet (SYN-ACK, ACK); a rank whose attempt was refused (a NAT that answers an
   unexpected SYN with a reset) tries again every :data:`RETRY_SECONDS` until the deadline.

gRPC-python dials addresses, not sockets, so the connection is joined to gRPC by a
:class:`Tunnel` on each end: the rank's channel dials a local :class:`PunchedRoute`; the end
dialed back (a shard, or a rank for peer streams) answers from its :class:`PunchPort`, which
joins the punched socket to its own server's port. The tunnel copies with ``splice(2)`` through
a pipe (the bytes never enter Python), two threads per connection. TLS and tokens travel end to
end inside the tunnel, exactly as on a direct connection.

The NAT must keep the port a host dials from (endpoint-independent mapping, as Linux's
masquerading and most home routers do): the shard dials the rank's port as the coordinator saw
it. Where it does not (a symmetric NAT), the punch fails within its deadline and the channel's
connection with it, named; ``GRADSTAR_NAT_TRAVERSAL=0`` on that host makes its shard carry its
own host's ranks only, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable

import grpc

from .addresses import split_host_port
from .relay import caller_host
from .status import error_from_rpc

log = logging.getLogger(__name__)

#: How long one end keeps trying to meet the other.
PUNCH_SECONDS = 10.0
#: The pause before trying again after a refused attempt (a reset from the other end's NAT or
#: host, which had not dialed yet).
RETRY_SECONDS = 0.05
#: Bytes one splice moves at most.
SPLICE_BYTES = 1 << 20
#: fcntl's F_SETPIPE_SZ (Linux; Python names it from 3.10 on).
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
#: Punches a punch port answers at once at most (PunchPort).
MAX_ANSWERS = 256
#: Connections a local route punches at once: gRPC dials one per channel, and again after a
#: failure, with its backoff.
MAX_PENDING = 4


#: How long the coordinator's probe of an advertised address may take: a host that drops
#: inbound connections (NAT, an outbound-only firewall) never answers the SYN.
PROBE_SECONDS = 1.0


def probes_caller(address: str, peer: str | None) -> bool:
    """Whether the coordinator may probe ``address`` for the shard or rank calling from
    ``peer`` (grpc's ``ipv4:HOST:PORT`` / ``ipv6:[HOST]:PORT``): only an address on the
    caller's own host, so that registering or joining cannot make the coordinator dial
    anywhere else. One that advertises another host (a DNS name, a NAT's public address) is
    taken as reachable, as it says."""
    host = split_host_port(address)[0]
    return bool(host) and host == caller_host(peer)


async def probe(address: str, seconds: float = PROBE_SECONDS) -> bool:
    """Whether a TCP connection to ``address`` (HOST:PORT) opens within ``seconds``: what
    tells the coordinator that ranks on other hosts can dial a shard or a rank's peer server
    there. An address without a host (":PORT") is on the coordinator's own host, which every
    rank reaches."""
    host, port = split_host_port(address)
    if not host:
        return True
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), seconds)
    except (OSError, ValueError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


def reusable_socket(port: int = 0, host: str = "", family: int = socket.AF_INET) -> socket.socket:
    """A TCP socket bound to ``port`` (0: any) that other sockets may bind as well: every punch
    of a host leaves from the same port, which its NAT maps to the same outside port."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host or ("::" if family == socket.AF_INET6 else "0.0.0.0"), port))
    except BaseException:
        sock.close()
        raise
    return sock


def family_of(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


async def punch(port: int, remote: tuple[str, int], deadline: float) -> socket.socket:
    """A TCP connection from local ``port`` to ``remote`` (host, port), which is dialing this
    end at the same time. ``deadline`` is on the running loop's clock.

    Raises:
        TimeoutError: the two ends did not meet by ``deadline``.
        OSError: the local port cannot be bound, or the last attempt's error once the deadline
            passed.
    """
    loop = asyncio.get_running_loop()
    family = family_of(remote[0])
    while True:
        sock = reusable_socket(port, family=family)
        sock.setblocking(False)
        left = deadline - loop.time()
        try:
            if left <= 0:
                raise TimeoutError
            await asyncio.wait_for(loop.sock_connect(sock, remote), left)
        except (ConnectionRefusedError, ConnectionResetError) as error:
            sock.close()
            if deadline - loop.time() <= RETRY_SECONDS:
                raise OSError(f"no answer from {remote[0]}:{remote[1]} but resets ({error})") \
                    from None
            await asyncio.sleep(RETRY_SECONDS)
            continue
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends, then end ``dst``'s writing."""
    try:
        if hasattr(os, "splice"):
            read, write = os.pipe()
            with contextlib.suppress(OSError):  # fewer, larger splices (Linux's max: 1 MiB)
                fcntl.fcntl(write, F_SETPIPE_SZ, SPLICE_BYTES)
            try:
                while n := os.splice(src.fileno(), write, SPLICE_BYTES):
                    while n:
                        n -= os.splice(read, dst.fileno(), n)
            finally:
                os.close(read)
                os.close(write)
        else:  # pragma: no cover - Linux has splice
            buffer = memoryview(bytearray(SPLICE_BYTES))
            while n := src.recv_into(buffer):
                dst.sendall(buffer[:n])
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


class Tunnel:
    """Two connected sockets joined both ways (a thread each way), closed once both ended."""

    def __init__(self, a: socket.socket, b: socket.socket) -> None:
        self._sockets = (a, b)
        self._left = 2
        self._lock = threading.Lock()
        for sock in self._sockets:
            sock.setblocking(True)
        self._threads = [threading.Thread(target=self._run, args=(src, dst), daemon=True,
                                          name="gradstar-tunnel")
                         for src, dst in ((a, b), (b, a))]

    def start(self) -> Tunnel:
        for thread in self._threads:
            thread.start()
        return self

    def _run(self, src: socket.socket, dst: socket.socket) -> None:
        _pump(src, dst)
        with self._lock:
            self._left -= 1
            done = self._left == 0
        if done:
            for sock in self._sockets:
                sock.close()

    @property
    def open(self) -> bool:
        """Whether either direction still runs."""
        return self._left > 0

    def close(self) -> None:
        """End both directions now (their threads then close the sockets)."""
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class PunchedRoute:
    """A local port that stands for a host behind NAT: a gRPC channel dials :attr:`address`,
    and each connection it opens is joined to one punched to ``remote`` (host, port).

    ``ask(port)`` asks the coordinator to have the other end dial this host's ``port``
    (raising a gradstar error if it refuses); it is called after this end's first SYN left.
    :attr:`last_error` says why the latest punch failed ('' if none did).
    """

    def __init__(self, remote: tuple[str, int], ask: Callable[[int], Awaitable[None]],
                 timeout: float = PUNCH_SECONDS) -> None:
        self.remote = remote
        self.timeout = timeout
        self.last_error = ""
        self._ask = ask
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=MAX_PENDING)
        self._listener.setblocking(False)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._tasks: set[asyncio.Task] = set()
        self._tunnels: list[Tunnel] = []
        self._serving: asyncio.Task | None = None

    def start(self) -> PunchedRoute:
        """Take connections (on the running loop); again: nothing."""
        if self._serving is None:
            self._serving = asyncio.ensure_future(self._serve())
        return self

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            if len(self._tasks) >= MAX_PENDING:
                conn.close()
                continue
            task = asyncio.ensure_future(self._join(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _join(self, conn: socket.socket) -> None:
        try:
            sock = await self.connect()
        except BaseException as error:
            conn.close()
            if isinstance(error, asyncio.CancelledError):
                raise
            self.last_error = f"{type(error).__name__}: {error}"
            log.warning("could not punch through to %s:%d: %s", *self.remote, self.last_error)
            return
        self.last_error = ""
        self._tunnels = [t for t in self._tunnels if t.open] + [Tunnel(conn, sock).start()]

    async def connect(self) -> socket.socket:
        """One punched connection to :attr:`remote` (see the module docstring). This end also
        listens on the port it dials from, for the case its own SYN was reset rather than
        dropped (the other end is reachable after all, or its NAT resets): the other end's SYN
        then finds the listener.

        Raises:
            TimeoutError, OSError: the ends did not meet within :attr:`timeout`.
            GradstarError: the coordinator refused the request.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        listener = reusable_socket(family=family_of(self.remote[0]))
        try:
            listener.listen(1)
            listener.setblocking(False)
            port = listener.getsockname()[1]
            ends = [asyncio.ensure_future(punch(port, self.remote, deadline)),
                    asyncio.ensure_future(_accept_from(listener, self.remote[0]))]
            try:
                await asyncio.sleep(0)  # the first SYN leaves before the other end is asked
                await self._ask(port)
                return await _first_of(ends, deadline - loop.time())
            finally:
                for end in ends:
                    end.cancel()
                await asyncio.gather(*ends, return_exceptions=True)
        finally:
            listener.close()

    async def close(self) -> None:
        tasks = [t for t in (self._serving, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        self._listener.close()
        for tunnel in self._tunnels:
            tunnel.close()


def asker(channel, method: str, metadata: tuple, what: str,
          where: str) -> Callable[[int], Awaitable[None]]:
    """A route's ``ask``: ``PeerRelay/Punch`` (``method``) on ``channel`` (the coordinator's
    collective port, ``where``) with ``metadata`` naming the caller and the other end; a
    refusal raises its gradstar error, naming ``what`` was asked."""
    async def ask(port: int) -> None:
        try:
            await channel.unary_unary(method)(port.to_bytes(2, "big"), metadata=metadata,
                                              timeout=PUNCH_SECONDS)
        except grpc.RpcError as error:
            raise error_from_rpc(error, what, where) from None
    return ask


async def _accept_from(listener: socket.socket, host: str) -> socket.socket:
    """The first connection ``listener`` takes from ``host`` (others are closed)."""
    loop = asyncio.get_running_loop()
    while True:
        conn, peer = await loop.sock_accept(listener)
        if peer[0] == host:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return conn
        conn.close()


async def _first_of(ends: list[asyncio.Future], timeout: float) -> socket.socket:
    """The socket of the first of ``ends`` that succeeds (a later success is closed); the last
    error if all fail, TimeoutError after ``timeout`` seconds."""
    pending = set(ends)
    error: BaseException = TimeoutError(f"no connection within {timeout:.3g} s")
    async with asyncio.timeout(max(timeout, 0)):
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for end in done:
                if end.exception() is None:
                    for other in pending:
                        other.add_done_callback(_close_result)
                    return end.result()
                error = end.exception()
    raise error


def _close_result(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()


async def answer(port: int, remote: tuple[str, int], local: tuple[str, int],
                 timeout: float = PUNCH_SECONDS) -> Tunnel:
    """The shard's half: punch from ``port`` to ``remote`` and join the connection to its own
    server at ``local`` (host, port).

    Raises:
        TimeoutError, OSError: the ends did not meet, or the local server did not answer.
    """
    loop = asyncio.get_running_loop()
    sock = await punch(port, remote, loop.time() + timeout)
    server = socket.socket(family_of(local[0]), socket.SOCK_STREAM)
    try:
        server.setblocking(False)
        await asyncio.wait_for(loop.sock_connect(server, local), timeout)
        server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        server.close()
        sock.close()
        raise
    return Tunnel(sock, server).start()


class PunchPort:
    """The port a shard or an outbound-only rank answers punches from, kept bound so that its
    NAT keeps its outside port, and the connections punched from it, each joined to the
    server at ``local`` (host, port). At most ``limit`` punches run at once: each holds a
    socket and a connection attempt until its deadline."""

    def __init__(self, local: tuple[str, int], host: str = "", limit: int = MAX_ANSWERS,
                 name: str = "this host") -> None:
        self._socket = reusable_socket(host=host, family=family_of(host))
        self.port: int = self._socket.getsockname()[1]
        self.local = local
        self.name = name
        self._limit = limit
        self._answers: set[asyncio.Task] = set()
        self._tunnels: list[Tunnel] = []

    def answer(self, remote: tuple[str, int]) -> bool:
        """Punch towards ``remote`` in the background (on the running loop) and join what
        meets to :attr:`local`; False, doing nothing, when ``limit`` punches run already."""
        if len(self._answers) >= self._limit:
            log.warning("%s: punch towards %s:%d refused (%d under way)", self.name, *remote,
                        self._limit)
            return False
        task = asyncio.ensure_future(self._answer(remote))
        self._answers.add(task)
        task.add_done_callback(self._answers.discard)
        return True

    async def _answer(self, remote: tuple[str, int]) -> None:
        try:
            tunnel = await answer(self.port, remote, self.local)
        except (OSError, TimeoutError) as error:
            log.warning("%s: no punched connection to %s:%d (%s)", self.name, *remote, error)
            return
        self._tunnels = [t for t in self._tunnels if t.open] + [tunnel]

    def close(self) -> None:
        """Stop the punches under way, end the punched connections, free the port."""
        for task in list(self._answers):
            task.cancel()
        for tunnel in self._tunnels:
            tunnel.close()
        self._socket.close()


__all__ = ["PROBE_SECONDS", "PUNCH_SECONDS", "PunchPort", "PunchedRoute", "Tunnel", "answer",
           "asker", "probe", "probes_caller", "punch", "reusable_socket"]
