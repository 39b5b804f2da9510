"""Who is on which host: one rank's place in the two levels (:class:`HostPlan`), derived alike
on every rank from the generation's peer table, without I/O."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostPlan:
    """Where one rank stands in the two levels.

    ``layout`` lists every host's ranks (global ranks, ascending), hosts ordered by their
    leaders' ranks: host ``j`` of the leaders group is ``layout[j]``, and its local rank ``i`` is
    global rank ``layout[j][i]``.
    """

    host: str  #: this rank's host key
    local_rank: int
    local_size: int
    leader: bool  #: the lowest rank of its host: it carries the host's part across
    host_index: int  #: the host's place among the hosts, ordered by their leaders' ranks
    hosts: int
    layout: tuple[tuple[int, ...], ...] = ()

    @property
    def rank(self) -> int:
        """This rank's global rank."""
        return self.layout[self.host_index][self.local_rank]

    @property
    def world_size(self) -> int:
        return sum(len(ranks) for ranks in self.layout)

    @property
    def uniform(self) -> bool:
        """Whether every host runs as many ranks: a host's block then has one size on every
        host, which the leaders' all_gather and reduce_scatter need (their segments are equal)."""
        return len({len(ranks) for ranks in self.layout}) == 1

    @property
    def order(self) -> tuple[int, ...]:
        """Global ranks in host-block order (host by host, in leader order): position ``p`` of
        a leaders' block-wise result belongs to rank ``order[p]``."""
        return tuple(r for ranks in self.layout for r in ranks)

    @property
    def in_rank_order(self) -> bool:
        """Whether host-block order is global rank order (each host's ranks contiguous, hosts
        in rank order): no rows need to move."""
        return self.order == tuple(range(self.world_size))

    def place(self, rank: int) -> tuple[int, int]:
        """``(host index, local rank)`` of global rank ``rank``.

        Raises:
            ValueError: ``rank`` is not in the layout.
        """
        for index, ranks in enumerate(self.layout):
            if rank in ranks:
                return index, ranks.index(rank)
        raise ValueError(f"rank {rank} is on none of the {self.hosts} hosts of this generation")


def plan(rank: int, hosts: dict[int, str]) -> HostPlan | None:
    """This rank's place in the two levels, or None when they would not help (one host, one
    rank per host, or a rank that announced no host)."""
    if not hosts or any(not key for key in hosts.values()):
        return None
    by_host: dict[str, list[int]] = {}
    for r in sorted(hosts):
        by_host.setdefault(hosts[r], []).append(r)
    if len(by_host) < 2 or all(len(ranks) == 1 for ranks in by_host.values()):
        return None
    mine = by_host[hosts[rank]]
    layout = tuple(sorted((tuple(ranks) for ranks in by_host.values()), key=lambda r: r[0]))
    return HostPlan(hosts[rank], mine.index(rank), len(mine), mine[0] == rank,
                    layout.index(tuple(mine)), len(layout), layout)


__all__ = ["HostPlan", "plan"]
