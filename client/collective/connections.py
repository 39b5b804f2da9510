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

Neither cap is the application's to lift (gRPC-python gives it no socket to set options on);
the host's settings are, where its owner may change them: :func:`host_tuning_advice` names them
once a round trip is long enough for them to matter (measured: a 64 MiB all_reduce across 4
hosts at 1 Gbit/s and 200 ms took 3.5 s as shipped and 1.6 s with both set; docs/regions.md).
The restart after idle has a second way out: Linux skips it for a congestion control with a
control loop of its own (BBR, which also paces its sends instead of bursting a window into the
path's queue); a host may choose one per route, for its far peers only, since BBR measured
slower than cubic on the 0 ms rows of the emulated cluster (docs/regions.md).

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
_SLOW_START_AFTER_IDLE = Path("/proc/sys/net/ipv4/tcp_slow_start_after_idle")
_CONGESTION_CONTROL = Path("/proc/sys/net/ipv4/tcp_congestion_control")
#: Congestion controls Linux never restarts after idle (they have a control loop of their own).
KEEPS_WINDOW_AFTER_IDLE = frozenset({"bbr", "bbr2", "bbr3"})
#: From this round trip on, the host's TCP settings cost a far link whole round trips.
FAR_RTT = 0.020
#: A send window that carries 1 Gbit/s at 200 ms and more.
TUNED_WINDOW = 64 << 20


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


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def host_tuning_advice(rtt_s: float, window_bytes: int | None = None,
                       slow_start_after_idle: Path = _SLOW_START_AFTER_IDLE,
                       congestion_control: Path = _CONGESTION_CONTROL) -> str | None:
    """A sentence naming this host's TCP settings that cost a link of round trip ``rtt_s``, and
    their values for far links; None below :data:`FAR_RTT` or where all are set so."""
    if rtt_s < FAR_RTT:
        return None
    window = send_window_bytes() if window_bytes is None else window_bytes
    control = _read(congestion_control)
    restarts = _read(slow_start_after_idle) not in ("", "0") and (
        control not in KEEPS_WINDOW_AFTER_IDLE)
    advice = []
    if restarts:
        advice.append(f"net.ipv4.tcp_slow_start_after_idle=0 or, for the far peers' routes only, "
                      f"BBR ('ip route change ROUTE congctl bbr'; {control or 'the default'} "
                      f"now): each collective after an idle spell starts again from a small "
                      f"window, doubling once per round trip")
    if window < TUNED_WINDOW:
        advice.append(f"net.ipv4.tcp_wmem='4096 16384 {TUNED_WINDOW}' (its largest value, "
                      f"{window >> 20} MiB, caps one connection at "
                      f"{window / rtt_s * 8 / 1e6:.0f} Mbit/s)")
    if not advice:
        return None
    return (f"the round trip to the hub is {rtt_s * 1e3:.0f} ms: on hosts you may tune, set "
            + " and ".join(advice) + " (docs/regions.md)")


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


__all__ = ["FILL_RATE", "MAX_CONNECTIONS", "connections_for", "host_tuning_advice",
           "round_trip", "send_window_bytes"]
