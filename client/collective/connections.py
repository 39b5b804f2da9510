"""How many TCP connections a rank opens to each target of its collectives (a hub shard, the
coordinator's collective port), from the round trip it measures to it.

One TCP connection carries at most its send window per round trip, and Linux caps that window
at ``tcp_wmem``'s largest value (4 MiB on common distributions): about 335 Mbit/s at 100 ms,
168 at 200 ms, whatever the link offers. After an idle spell (the compute between two steps)
a connection also starts again from a small window and doubles it once per round trip. Several
connections, each with its own window, carry their sum and ramp up together; gRPC's HTTP/2
windows sit on top of one connection and cannot lift its cap (a larger stream window measured
slower, not faster: docs/performance.md, "Training across regions").

The rule: enough connections that their windows carry :data:`FILL_RATE` bytes per second at the
measured round trip, at most :data:`MAX_CONNECTIONS`; one on a LAN. ``connections`` in
:class:`gradstar.config.ClientSettings` (``GRADSTAR_CONNECTIONS``) overrides it.

The round trip is the fastest of :data:`PROBES` health checks (``grpc.health.v1``) on the
connection the rank already has to the target: any answer is one round trip, a refusal
(``UNIMPLEMENTED`` where a port serves no health service) as well as ``SERVING``. A target that
does not answer within the timeout counts as near (one connection).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

#: Bytes per second the connections to one target should be able to carry (1 Gbit/s).
FILL_RATE = 125e6
MAX_CONNECTIONS = 8
#: Health checks whose fastest answer is the round trip.
PROBES = 3
#: The send window assumed where /proc/sys/net/ipv4/tcp_wmem cannot be read (Linux's default).
DEFAULT_SEND_WINDOW = 4 << 20
_UNANSWERED = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                         grpc.StatusCode.CANCELLED})
_TCP_WMEM = Path("/proc/sys/net/ipv4/tcp_wmem")


def send_window_bytes(path: Path = _TCP_WMEM) -> int:
    """The largest send buffer TCP autotuning gives a connection here (tcp_wmem's third
    value), or :data:`DEFAULT_SEND_WINDOW` where it cannot be read."""
    try:
        return max(1, int(path.read_text().split()[2]))
    except (OSError, ValueError, IndexError):
        return DEFAULT_SEND_WINDOW


def connections_for(rtt_s: float, window_bytes: int | None = None,
                    rate: float = FILL_RATE) -> int:
    """Connections whose windows (``window_bytes`` each, default :func:`send_window_bytes`)
    carry ``rate`` bytes per second at round trip ``rtt_s``: at least 1, at most
    :data:`MAX_CONNECTIONS`."""
    window = send_window_bytes() if window_bytes is None else window_bytes
    if not rtt_s > 0:
        return 1
    return max(1, min(MAX_CONNECTIONS, math.ceil(rate * rtt_s / window)))


async def round_trip(channel: grpc.aio.Channel, metadata, timeout: float) -> float:
    """Seconds of the fastest of :data:`PROBES` health checks on ``channel`` (connected
    already); 0.0 if the target answers none within ``timeout`` each."""
    check = health_pb2_grpc.HealthStub(channel).Check
    fastest = math.inf
    for _ in range(PROBES):
        t0 = time.perf_counter()
        try:
            await check(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=timeout)
        except grpc.aio.AioRpcError as error:
            if error.code() in _UNANSWERED:
                log.debug("no round trip measured: the health check failed (%s)",
                          error.code())
                return 0.0
        fastest = min(fastest, time.perf_counter() - t0)
    return fastest


__all__ = ["FILL_RATE", "MAX_CONNECTIONS", "connections_for", "round_trip",
           "send_window_bytes"]
