"""A compose-like network made of Linux network namespaces, for running services as processes.

:func:`service_network` gives each named service a host of an unshaped emulated cluster
(:mod:`benchmarks.emulated_cluster`): its own network namespace with one interface ``eth0`` on
a private bridge (itself in a namespace of its own, so nothing touches the host's network), an
address in 10.213.0.0/24, and an ``/etc/hosts`` that resolves every service name, as compose's
network DNS does. Where namespaces cannot be made (not root, no ``ip``, a sandbox that forbids
them) it yields a loopback network instead and says why; the caller adapts its addresses.
Everything created is removed when the context exits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from benchmarks.emulated_cluster import ClusterUnavailable, EmulatedCluster

SUBNET = "10.213.0"


@dataclass
class ServiceNetwork:
    """Where each service runs: ``argv(service, cmd)`` wraps a command to run inside it."""

    kind: str  # "netns" or "loopback"
    reason: str
    cluster: EmulatedCluster | None = None
    addresses: dict[str, str] = field(default_factory=dict)
    namespaces: dict[str, str] = field(default_factory=dict)

    def argv(self, service: str, command: list[str]) -> list[str]:
        if self.cluster is not None:
            return self.cluster.argv(service, command)
        return list(command)

    def describe(self) -> str:
        if self.kind == "netns":
            where = ", ".join(f"{s} {a}" for s, a in self.addresses.items())
            return f"network namespaces on a bridge ({where})"
        return f"loopback, because {self.reason}"

    def interface_bytes(self, service: str) -> tuple[int, int]:
        """(received, sent) bytes of the service's eth0 (netns only)."""
        link = self.cluster.link_bytes()[service]
        return link.rx, link.tx


@contextlib.contextmanager
def service_network(services: list[str], **cluster_options) -> Iterator[ServiceNetwork]:
    """The network; ``cluster_options`` go to :class:`EmulatedCluster` (``rtt=100``: every two
    services 100 ms apart through delay lines)."""
    cluster = EmulatedCluster(services, rate=None, subnet=SUBNET, first=2, **cluster_options)
    try:
        cluster.build()
    except ClusterUnavailable as error:
        unavailable = f"network namespaces are not available here ({error})"
    else:
        unavailable = None
    if unavailable is not None:
        yield ServiceNetwork("loopback", unavailable)
        return
    try:
        yield ServiceNetwork("netns", "", cluster,
                             {name: h.address for name, h in cluster.hosts.items()},
                             {name: h.namespace for name, h in cluster.hosts.items()})
    finally:
        cluster.close()
