"""benchmarks/cluster.py's topologies: where each process runs (:class:`Placement` for a
:class:`Layout` of hosts and ranks) and the link-bound model of each (:func:`link_model`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from emulated_cluster import (
    LinkBytes,
)

REPO = Path(__file__).resolve().parents[1]
COORDINATOR_PORT = 29400  # each host is a fresh namespace: nothing else listens there
STORE_PORT = 29500
DDP_BATCH = 32  # rows per rank per step, as benchmarks/ddp_step.py
MB = 1e6
GB = 1e9


# -- placements: where each process of a topology runs ------------------------------------------


@dataclass(frozen=True)
class Layout:
    """The run's rank hosts and ranks: rank i runs on ``rank_hosts[i]``."""

    hosts: int
    ranks_per_host: int

    @property
    def nodes(self) -> list[str]:
        return [f"node{h}" for h in range(self.hosts)]

    @property
    def rank_hosts(self) -> list[str]:
        return [f"node{r // self.ranks_per_host}"
                for r in range(self.hosts * self.ranks_per_host)]

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host


@dataclass(frozen=True)
class Placement:
    """Where a topology runs its hub: the coordinator's host (None: gloo, no hub) and one host
    per shard (slot k on ``shard_hosts[k]``; empty: the coordinator carries the collectives)."""

    coordinator: str | None
    shard_hosts: tuple[str, ...] = ()
    #: The shards are node-local ones, as gradstar's launchers start them: registered for the
    #: row's job (``--for-job``; each size's job is a subgroup of it), advertised at the
    #: address gradstar picks by default, and a host's ranks combine on theirs first.
    node_local: bool = False
    #: gloo with torch's bf16_compress_hook semantics (bfloat16 on the wire, added per hop).
    bf16_hook: bool = False


def gloo(layout: Layout) -> Placement:
    return Placement(None)


def gloo_bf16_hook(layout: Layout) -> Placement:
    return Placement(None, bf16_hook=True)


def hub_on_rank0(layout: Layout) -> Placement:
    return Placement(layout.rank_hosts[0])


def hub_own_host(layout: Layout) -> Placement:
    return Placement("hub")


def shards_extra_hosts(layout: Layout) -> Placement:
    return Placement("hub", tuple(f"shard{k}" for k in range(layout.hosts)))


def node_local(layout: Layout) -> Placement:
    """One shard on each rank host, started as ``gradstar worker``, ``gradstar launch
    --coordinator`` and the env:// drop-in start them (gradstar.node_shard): ``gradstar shard
    --for-job JOB`` with the address it advertises by default."""
    return Placement(layout.rank_hosts[0], tuple(layout.nodes), node_local=True)


TOPOLOGIES: dict[str, Callable[[Layout], Placement]] = {
    "gloo": gloo, "gloo-bf16-hook": gloo_bf16_hook, "hub-on-rank0": hub_on_rank0,
    "hub-own-host": hub_own_host, "shards-extra-hosts": shards_extra_hosts,
    "node-local": node_local}
#: The rows of a run without --topologies (the compressed gloo row is asked for by name).
DEFAULT_TOPOLOGIES = [name for name in TOPOLOGIES if name != "gloo-bf16-hook"]


def extra_hosts(names: Sequence[str], layout: Layout) -> list[str]:
    """The hosts beyond the rank hosts that ``names`` need, in a stable order."""
    needed: list[str] = []
    for name in names:
        placement = TOPOLOGIES[name](layout)
        for host in (placement.coordinator, *placement.shard_hosts):
            if host is not None and host not in layout.nodes and host not in needed:
                needed.append(host)
    return needed


# -- the link model -----------------------------------------------------------------------------


def link_model(placement: Placement, layout: Layout, nbytes: int,
               wire: str | None = None) -> dict[str, LinkBytes]:
    """The bytes each host's link carries per all_reduce of ``nbytes``, from the flows alone.

    gloo: rank i sends 2(n-1)/n of the tensor to rank i+1 (its ring). gradstar: each rank
    sends 1/K of the tensor to each of the K shards (the coordinator when K = 0) and gets as
    much back. A flow between two ranks' processes on one host crosses no link. A wire format
    (or the bf16 hook) scales every flow by its bytes per float32 byte.
    """
    n = layout.world_size
    if wire is not None:
        from gradstar.wire.formats import wire_format

        nbytes = nbytes * wire_format(wire).ratio()
    elif placement.bf16_hook:
        nbytes = nbytes / 2
    flows: list[tuple[str, str, float]] = []
    if placement.node_local:  # a host's ranks combine first: one S/K flow per host and shard
        targets = placement.shard_hosts
        for host in layout.nodes:
            for target in targets:
                flows += [(host, target, nbytes / len(targets)),
                          (target, host, nbytes / len(targets))]
    elif placement.coordinator is None:
        hosts = layout.rank_hosts
        flows = [(hosts[i], hosts[(i + 1) % n], 2 * (n - 1) / n * nbytes) for i in range(n)]
    else:
        targets = list(placement.shard_hosts) or [placement.coordinator]
        for host in layout.rank_hosts:
            for target in targets:
                flows += [(host, target, nbytes / len(targets)),
                          (target, host, nbytes / len(targets))]
    tx: dict[str, float] = {}
    rx: dict[str, float] = {}
    for src, dst, size in flows:
        if src != dst:
            tx[src] = tx.get(src, 0.0) + size
            rx[dst] = rx.get(dst, 0.0) + size
    return {h: LinkBytes(round(rx.get(h, 0)), round(tx.get(h, 0))) for h in {*tx, *rx}}


def busiest(links: dict[str, LinkBytes]) -> float:
    return max((max(b.rx, b.tx) for b in links.values()), default=0.0)


# -- the rank program ---------------------------------------------------------------------------
