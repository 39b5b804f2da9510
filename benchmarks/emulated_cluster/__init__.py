"""The emulated cluster: hosts as Linux network namespaces on a bridge, their links shaped by
token buckets and, where asked, made far by a packet-level delay line. Benchmarks and
``tests/cluster`` build their hosts with it.

- :mod:`.cluster`: :class:`EmulatedCluster`, its hosts, links and processes;
- :mod:`.links`: a link's rate notation, round-trip convention and byte counters;
- :mod:`.congestion`: each host's TCP congestion control, and the machine-wide list it needs;
- :mod:`.delay_line` and ``delay_line.c``: the delay line, compiled on first use into
  ``build/``;
- :mod:`.outbound`: outbound-only hosts, as behind NAT (nftables rules in a host's namespace),
  applied by :meth:`EmulatedCluster.block_inbound`.

Nothing here imports gradstar: the library must never depend on it.
"""

from .cluster import NETNS_ETC, STOP_GRACE, SUBNET, ClusterUnavailable, EmulatedCluster, Host
from .congestion import CONGESTION_CONTROL, allowing_congestion_control
from .delay_line import DelayLine, DelayLineStats, DirectionStats
from .links import LinkBytes, one_way_delays, parse_rtt, rate_bytes_per_second

__all__ = [
    "CONGESTION_CONTROL",
    "NETNS_ETC",
    "STOP_GRACE",
    "SUBNET",
    "ClusterUnavailable",
    "DelayLine",
    "DelayLineStats",
    "DirectionStats",
    "EmulatedCluster",
    "Host",
    "LinkBytes",
    "allowing_congestion_control",
    "one_way_delays",
    "parse_rtt",
    "rate_bytes_per_second",
]
