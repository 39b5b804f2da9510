"""Who is on which host, without sockets: the two-level all_reduce's plan
(:func:`gradstar.client.hierarchy.plan`), the stripes each group gets
(:meth:`ShardRegistry.stripes_for`) and how a failed stage is named."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from gradstar.client.hierarchy import HostHierarchy, HostPlan, plan
from gradstar.config import ClientSettings
from gradstar.coordinator.rendezvous import Rendezvous
from gradstar.coordinator.shards import ShardRegistry
from gradstar.errors import CollectiveTimeoutError, RankLostError
from gradstar.node_shard import HOST_GROUP
from gradstar.proto.v1 import shard_pb2 as spb


def test_ranks_are_grouped_by_host_and_hosts_ordered_by_their_lowest_rank():
    hosts = {0: "b", 1: "a", 2: "b", 3: "a", 4: "c"}
    layout = ((0, 2), (1, 3), (4,))
    assert plan(0, hosts) == HostPlan("b", 0, 2, True, 0, 3, layout)
    assert plan(2, hosts) == HostPlan("b", 1, 2, False, 0, 3, layout)
    assert plan(1, hosts) == HostPlan("a", 0, 2, True, 1, 3, layout)
    assert plan(3, hosts) == HostPlan("a", 1, 2, False, 1, 3, layout)
    assert plan(4, hosts) == HostPlan("c", 0, 1, True, 2, 3, layout)
    assert not plan(4, hosts).uniform  # all_gather and reduce_scatter stay flat here


def test_no_two_levels_where_they_cannot_help():
    assert plan(0, {0: "a", 1: "a"}) is None  # one host
    assert plan(0, {0: "a", 1: "b"}) is None  # one rank per host
    assert plan(0, {0: "a", 1: "", 2: "a"}) is None  # a rank that announced no host


def _registry_with(shards: list[tuple[str, str]]) -> ShardRegistry:
    registry = ShardRegistry(Rendezvous(heartbeat_timeout=10.0))
    for index, (job, host) in enumerate(shards):
        registry.register(spb.ShardHello(address=f"10.0.0.{index}:1", job=job, host=host))
    return registry


def test_a_job_stripes_over_its_node_shards_and_a_host_group_over_its_hosts_alone():
    async def main():
        registry = _registry_with([("", ""), ("j", "h1"), ("j", "h2"), ("other", "h1")])
        addresses = lambda job: [r.address for r in registry.stripes_for(job)]  # noqa: E731
        assert addresses("j") == ["10.0.0.1:1", "10.0.0.2:1"]
        assert addresses("j/g1/leaders") == ["10.0.0.1:1", "10.0.0.2:1"]
        assert addresses(f"j/g1{HOST_GROUP}h2") == ["10.0.0.2:1"]
        assert addresses("jj") == ["10.0.0.0:1"]  # not a subgroup of j: the shared shards
        assert addresses("unrelated") == ["10.0.0.0:1"]

    asyncio.run(main())


def test_outbound_only_shards_carry_their_own_host_only():
    """A shard other hosts cannot dial (NAT) takes no stripe of a collective across hosts; its
    own host's group still goes to it, and its host is named outbound-only for peer sends."""
    async def main():
        registry = ShardRegistry(Rendezvous(heartbeat_timeout=10.0))
        for index, (host, reachable) in enumerate([("h0", True), ("h1", False),
                                                   ("h2", False)]):
            registry.register(spb.ShardHello(address=f"10.0.0.{index}:1", job="j", host=host),
                              job_scoped=True, reachable=reachable)
        addresses = lambda job: [r.address for r in registry.stripes_for(job)]  # noqa: E731
        assert addresses("j") == ["10.0.0.0:1"]
        assert addresses("j/g1/leaders") == ["10.0.0.0:1"]
        assert addresses(f"j/g1{HOST_GROUP}h1") == ["10.0.0.1:1"]
        assert registry.outbound_hosts("j") == {"h1", "h2"}
        assert registry.outbound_hosts("other") == set()

    asyncio.run(main())


def test_a_failed_stage_is_named_by_the_ranks_own_generation_when_the_hub_has_a_verdict():
    verdicts = []

    async def verdict():
        return verdicts[-1] if verdicts else None

    group = SimpleNamespace(settings=ClientSettings(), shards=[], rank=0,
                            session=SimpleNamespace(verdict=verdict, ride=None))
    hosts = HostHierarchy(group, {0: "a", 1: "a"}, join=None)
    stage = CollectiveTimeoutError("a leaders' stage timed out")
    assert asyncio.run(hosts._named(stage)) is stage  # no verdict: the stage's own error
    verdicts.append(RankLostError("rank 1 was lost"))
    assert asyncio.run(hosts._named(stage)) is verdicts[-1]
