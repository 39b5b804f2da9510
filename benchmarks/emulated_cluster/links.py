"""What a host's link is: its rate in tc's notation, its round trip, and its byte counters.

Round trips follow the cluster's convention (:mod:`.cluster`): ``rtt=MS`` puts every two hosts
MS apart, ``rtt={host: MS}`` gives each host its round trip to the core (the bridge), so that
two hosts are the sum of theirs apart.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)$")
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


@dataclass(frozen=True)
class LinkBytes:
    """Bytes a host's link carried so far, from the host's side: ``rx`` in, ``tx`` out."""

    rx: int
    tx: int

    def __sub__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(self.rx - other.rx, self.tx - other.tx)


def rate_bytes_per_second(rate: str) -> float:
    """``tc``'s rate notation in bytes per second: ``200mbit`` -> 25e6 (tc's k, m, g are powers
    of 1000; ``bps`` is bytes per second).

    Raises:
        ValueError: ``rate`` is not a number followed by [kmgt]bit or [kmgt]bps.
    """
    match = _RATE.match(rate.strip().lower())
    if match is None:
        raise ValueError(f"rate {rate!r} is not in tc's notation, e.g. 200mbit or 25mbps")
    value = float(match[1]) * _UNITS[match[2]]
    return value / 8 if match[3] == "bit" else value


def one_way_delays(names: Sequence[str], rtt: float | Mapping[str, float] | None,
                   ) -> dict[str, float]:
    """Each host's access-link delay, one way, in seconds, from ``rtt`` in milliseconds (the
    module's convention: a number is every pair's round trip, a map each host's to the core).

    Raises:
        ValueError: a delay that is negative or not finite, or a map naming no such host.
    """
    if rtt is None:
        return dict.fromkeys(names, 0.0)
    if isinstance(rtt, Mapping):
        unknown = sorted(set(rtt) - set(names))
        if unknown:
            raise ValueError(f"rtt names hosts the cluster does not have: {unknown}")
        access_ms = {n: float(rtt.get(n, 0.0)) for n in names}
    else:
        access_ms = dict.fromkeys(names, float(rtt) / 2)
    if not all(math.isfinite(ms) and ms >= 0 for ms in access_ms.values()):
        raise ValueError(f"round trips must be finite and at least 0 ms: {rtt!r}")
    return {n: ms / 2 / 1e3 for n, ms in access_ms.items()}


def parse_rtt(words: Sequence[str]) -> float | dict[str, float]:
    """A command line's round trip: one number of milliseconds (``["50"]``), or each host's
    round trip to the core (``["node0=5", "node1=45"]``), as ``EmulatedCluster(rtt=...)`` takes it.

    Raises:
        ValueError: neither form, or a number that is not one.
    """
    if len(words) == 1 and "=" not in words[0]:
        return float(words[0])
    if not words or not all(w.count("=") == 1 for w in words):
        raise ValueError(f"--rtt takes MS or HOST=MS ...: {' '.join(words)!r}")
    return {host: float(ms) for host, ms in (w.split("=") for w in words)}
