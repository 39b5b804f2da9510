"""The ``cluster`` fixture: emulated clusters (:mod:`benchmarks.emulated_cluster`) for tests.

``cluster(["node0", "node1"], rate="200mbit")`` builds hosts as network namespaces on a bridge,
each host link shaped both ways, and returns the :class:`EmulatedCluster`; every keyword goes
to it, so ``cluster(hosts, rtt=50)`` puts the hosts 50 ms apart through delay lines and
``rtt={"node0": 10, "node1": 40}`` gives each host its round trip to the core (the two: 50
ms). Every cluster the test built is closed after it (its processes stopped, its namespaces
removed), whether the test passed, failed or was interrupted. Where this machine cannot build
one (not root, no ``ip`` or ``tc``, no gcc for a delay line, namespaces forbidden, a
congestion control the kernel lacks) the test FAILS with the reason: a skipped cluster test
proves nothing about multi-host, and CI runs as root.
Tests that take their hosts from :func:`tests.runtime.netns.service_network` fail the same way
through :func:`tests.cluster.jobs.hosts_network`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

from benchmarks.emulated_cluster import ClusterUnavailable, EmulatedCluster

MakeCluster = Callable[..., EmulatedCluster]


@pytest.fixture
def cluster() -> Iterator[MakeCluster]:
    built: list[EmulatedCluster] = []

    def make(hosts: Sequence[str], **options: object) -> EmulatedCluster:
        made = EmulatedCluster(hosts, **options)
        try:
            made.build()
        except ClusterUnavailable as error:
            pytest.fail(f"no emulated cluster here: {error}", pytrace=False)
        built.append(made)
        return made

    try:
        yield make
    finally:
        for made in reversed(built):
            made.close()
