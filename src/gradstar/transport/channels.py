"""The one place gRPC channels and servers are built, with every option explained."""

from __future__ import annotations

from pathlib import Path

import grpc

from gradstar.config import ClientSettings
from gradstar.wire import CHUNK_HEADER_BYTES, MAX_CHUNK_BYTES

from .addresses import split_host_port
from .auth import bearer

# A chunk frame plus its header, with room for control messages; anything larger is refused by
# gRPC itself before the application allocates for it.
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + CHUNK_HEADER_BYTES + 64 * 1024
#: Bytes of tensor data per message of a protobuf-framed stream (the Rounds and Steps
#: services' parts): well below MAX_MESSAGE_BYTES, large enough that the per-message cost is
#: noise beside the copy.
PART_BYTES = 1 << 20

KEEPALIVE_MS = 1_000
#: The time a connection attempt may take before gRPC tries again (TCP's handshake, TLS's,
#: and the server's HTTP/2 settings: a few round trips, each up to 200 ms across regions).
CONNECT_TIMEOUT_MS = 2_000
#: Control connections and the coordinator: a peer that answers no ping for 4 s is gone (a host
#: cut off: named errors on the others within 6 s). Only small messages share these
#: connections, so a full link delays their pings by its queue (tbf's 50 ms here), not by MBs
#: of socket buffers. gRPC also sets this as the socket's TCP_USER_TIMEOUT (what it may leave
#: unacknowledged), so it must outlast TCP's own repair of a lost packet on a live far path:
#: a lost segment is sent again after a retransmission timeout of 200 ms plus the round trip,
#: doubling each time, so at 100-200 ms a packet lost three times running is through after
#: 2.1-2.8 s. 2 s allowed two: on a lossy 200 ms path (BBR overfilling a queue; 5-10% random
#: loss on the emulated cluster) live shards' and sessions' control connections were dropped
#: ("ping timeout", "Connection timed out"), and a link silent for 1.5 s at 100 ms dropped
#: them all (tests/cluster/test_hosts.py; docs/regions.md, "Known problems").
KEEPALIVE_TIMEOUT_MS = 4_000
#: A client's keepalive on a connection that carries tensors: its pings wait behind the bytes
#: queued in both directions' socket buffers (MBs: on a 200 Mbit/s link shared by 4 streams,
#: the ping and its ack each waited up to ~0.7 s, more on a loaded CPU), and a 2 s timeout
#: dropped healthy connections mid-collective (benchmarks/cluster.py, 64 MiB through one hub:
#: "Stream removed (ping timeout)"). Losses are found on the control connections instead: the
#: rank's session (its own connection, below) and the hub's pings.
BULK_KEEPALIVE_TIMEOUT_MS = 20_000


def _keepalive(timeout_ms: int) -> list[tuple[str, int]]:
    return [
        # Ping every 1 s and drop the connection when a ping is not answered in time, so a
        # frozen or partitioned peer is noticed in seconds rather than after TCP's minutes.
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # Without this ping timeout gRPC waits 60 s for a ping ack on a busy connection.
        ("grpc.http2.ping_timeout_ms", timeout_ms),
    ]


_COMMON_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Keepalive must also run while a rank is idle between collectives.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

_CLIENT_COMMON = [
    *_COMMON_OPTIONS,
    # Fail fast on an unreachable coordinator instead of backing off for up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    # gRPC reads this as the shortest time a connection attempt may take (its minimum connect
    # timeout), not as a backoff: at 200 ms, a TCP handshake and the server's HTTP/2 settings
    # across a 100-200 ms round trip timed out ("timed out before receiving SETTINGS frame")
    # and a collective failed. CONNECT_TIMEOUT_MS covers a TLS handshake at 500 ms.
    ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
    # Each process group gets its own TCP connection, so ranks in one process do not share one
    # connection's flow-control window.
    ("grpc.use_local_subchannel_pool", 1),
]

#: Control connections: a rank's session, a shard's registration. They carry small messages
#: only, so their pings are answered within the timeout even while the host's link is full.
CLIENT_OPTIONS = [*_CLIENT_COMMON, *_keepalive(KEEPALIVE_TIMEOUT_MS)]
#: Connections that carry collectives and peer streams (each channel has its own subchannel
#: pool, above, so never the same TCP connection as a control channel to the same address).
BULK_CLIENT_OPTIONS = [*_CLIENT_COMMON, *_keepalive(BULK_KEEPALIVE_TIMEOUT_MS)]

_SERVER_COMMON = [
    *_COMMON_OPTIONS,
    # Accept our clients' 1 s keepalive pings; the default policy answers them with GOAWAY.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
    # Two coordinators must never share a port silently (tests bind port 0 many times).
    ("grpc.so_reuseport", 0),
]

#: The coordinator: it serves the ranks' sessions and the shards' registrations, whose loss it
#: must notice within seconds (a host gone: named errors on the others within 6 s).
SERVER_OPTIONS = [*_SERVER_COMMON, *_keepalive(KEEPALIVE_TIMEOUT_MS)]
#: Servers that carry only tensors (hub shards, ranks' peer servers): their pings queue behind
#: full socket buffers like a bulk client's (8 ranks x 64 MiB into one 200 Mbit/s host lost
#: connections to 2-3 s pings), and what they would notice is noticed on the control
#: connections first: a rank's session, a shard's registration stream.
BULK_SERVER_OPTIONS = [*_SERVER_COMMON, *_keepalive(BULK_KEEPALIVE_TIMEOUT_MS)]


def stream_window_options(window_bytes: int) -> list[tuple[str, int]]:
    """gRPC server options that fix each stream's receive window at ``window_bytes`` (0: gRPC's
    own windows, sized by BDP probing, unbounded in advance).

    The window is what gRPC accepts of a peer's stream ahead of what the server has read, so a
    stream the hub holds back (its read window, :mod:`gradstar.coordinator.collective.window`)
    costs the hub up to this much besides. Left to gRPC it follows gRPC's estimate of the link's
    bandwidth-delay product, which a loaded host inflates (see
    :attr:`gradstar.config.CoordinatorSettings.stream_window_bytes`)."""
    if window_bytes <= 0:
        return []
    # Without BDP probing the window stays at the lookahead (the HTTP/2 initial window size).
    # The probing also sized the frames peers may send to the window; off, they would stay at
    # HTTP/2's 16 KiB, which costs large collectives time and hub CPU (docs/performance.md,
    # "Figures behind the code"), so they are sized as the probing would (HTTP/2 allows
    # 16 KiB to 16 MiB - 1).
    frame = max(1 << 14, min(window_bytes, (1 << 24) - 1))
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", window_bytes),
            ("grpc.http2.max_frame_size", frame)]


def _read(path: Path | None) -> bytes | None:
    return Path(path).read_bytes() if path is not None else None


def client_credentials(
    ca: Path | None, cert: Path | None = None, key: Path | None = None
) -> grpc.ChannelCredentials:
    """TLS credentials; with ``cert`` and ``key`` the client also proves itself (mutual TLS)."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca), private_key=_read(key), certificate_chain=_read(cert)
    )


def server_credentials(
    cert: Path, key: Path, client_ca: Path | None = None
) -> grpc.ServerCredentials:
    """TLS server credentials; with ``client_ca`` clients must present a certificate."""
    return grpc.ssl_server_credentials(
        [(_read(key), _read(cert))],
        root_certificates=_read(client_ca),
        require_client_auth=client_ca is not None,
    )


def secure_or_insecure_channel(
    target: str, credentials: grpc.ChannelCredentials | None, *, bulk: bool = False,
    authority: str = "",
) -> grpc.aio.Channel:
    """An asyncio channel to ``target`` with the options above (``bulk``: for tensors).
    ``authority`` (HOST:PORT): the server ``target`` stands for (a local tunnel's port,
    gradstar.transport.traversal), whose name TLS checks the certificate against."""
    options = BULK_CLIENT_OPTIONS if bulk else CLIENT_OPTIONS
    if authority:
        options = [*options, ("grpc.default_authority", authority),
                   ("grpc.ssl_target_name_override", split_host_port(authority)[0])]
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)


def open_blocking_channel(settings: ClientSettings, target: str) -> grpc.Channel:
    """A blocking (non-asyncio) channel to ``target`` for tensors, with the same TLS settings
    and options as :func:`open_channel` with ``bulk``: a call on it waits in the caller's own
    thread, with no hop to an event loop (gradstar.client.collective.direct)."""
    tls = settings.tls_ca or settings.tls_cert
    if not tls:
        return grpc.insecure_channel(target, options=BULK_CLIENT_OPTIONS)
    creds = client_credentials(settings.tls_ca, settings.tls_cert, settings.tls_key)
    return grpc.secure_channel(target, creds, options=BULK_CLIENT_OPTIONS)


def open_channel(settings: ClientSettings, target: str | None = None, *,
                 bulk: bool = False, authority: str = "") -> grpc.aio.Channel:
    """A channel to ``target`` (default: the coordinator), with TLS when a CA or client
    certificate is configured; ``bulk`` for one that carries tensors (its own TCP connection,
    a keepalive that tolerates full queues); ``authority``: see
    :func:`secure_or_insecure_channel`."""
    tls = settings.tls_ca or settings.tls_cert
    creds = (client_credentials(settings.tls_ca, settings.tls_cert, settings.tls_key)
             if tls else None)
    return secure_or_insecure_channel(target or settings.coordinator, creds, bulk=bulk,
                                      authority=authority)


def call_metadata(settings: ClientSettings) -> tuple[tuple[str, str], ...]:
    """Call metadata that presents the job token, if one is configured."""
    if settings.token is None:
        return ()
    return bearer(settings.token.get_secret_value())
