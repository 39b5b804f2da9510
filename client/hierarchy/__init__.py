"""Two-level collectives: a host's ranks combine on their host before anything crosses its link.

Why. Across hosts the cost is bytes on links. With one node-local shard per host
(:mod:`gradstar.node_shard`) and every rank striping its tensor over all of them, a host with R
ranks sends and receives R times what one rank would: R·2(H-1)/H·S per all_reduce of S bytes,
R times a ring's bytes; a broadcast crosses into a host once per rank, an all_gather carries each
rank's tensor to every other rank separately. A host should move its ranks' part once.

Groups. Each rank joins, right after its generation formed, up to two more groups of the same
coordinator (every rank derives them from the generation's peer table, which carries each
rank's host key, :func:`gradstar.transport.shm.host_key`; :mod:`.layout`):

- ``JOB/gN/host-KEY``: the ranks of its host, in global rank order. Its generations stripe
  over the job's shard on that host alone (:meth:`ShardRegistry.stripes_for`), reached over
  shared memory: nothing crosses a link.
- ``JOB/gN/leaders``: one rank per host, the lowest, hosts in the order of their leaders'
  ranks. Its generations stripe over every node-local shard of the job.

Programs. Each op is a list of stages, one collective each in one of the two groups, then a
finish (:mod:`.programs`): a host-group stage over shared memory, the leaders' stage across
hosts, a host-group broadcast. Per host link, each way, with H hosts of R ranks (n = HR), a
node-local shard on each (K = H stripes) and S bytes per rank (docs/multi-host.md has the flat
path's figures beside them, ``tests/cluster/test_host_collectives.py`` checks them):

- all_reduce: 2(H-1)/H·S (flat: R times that);
- broadcast: 2(H-1)/H·S out of src's host and nothing in; S into every other host and
  (H-2)/H·S out (the leaders' stripes of it that other leaders fetch from its shard);
- all_gather: (H-1)·R·S, the host's block once to each other host (flat: (H-1)·R²·S);
- reduce_scatter: (H-1)/H·(1 + 1/H)·S: the host's partial to the other shards, and its share,
  spread over every shard, back (flat: R(H-1)/H·(1 + 1/n)·S).

Exactness. Integer dtypes are bit-identical to one hub; float sums differ only in the order of
additions (a host's ranks first); ``mean`` sums at both levels and divides by the world size at
the end. Half-precision and integer ``mean`` stay on the flat path, where the hub accumulates
every rank's contribution in float32 once; all_gather and reduce_scatter stay flat unless every
host runs as many ranks (:meth:`HostHierarchy.takes`). Hosts whose ranks are not contiguous get
the flat path's result: rows move to host-block order and back.

Order. Collectives are matched on the hub by their seq in their group, and a later stage can
only be issued once the stage before it has ended, which happens at different times on
different ranks. So each call takes the seqs of all its stages when it is made, on the caller's
thread (:meth:`AsyncProcessGroup.reserve`): every rank reserves a group's stages in call order,
and they pair up whatever order they are issued in. (Taking a stage's seq when it was issued,
as the first version did, let a host broadcast of one all_reduce and the host all_reduce of the
next swap places on one rank and not on another.) A stage that fails, or a call cancelled,
gives up its stages not yet issued, so the other ranks' fail at once, not at their timeout.

Failures. A failure in a subgroup names that subgroup's ranks; the rank's own generation fails
too when a rank is lost, so the error raised is the generation's (naming global ranks) when the
hub reports one within the session's verdict grace, else the subgroup's.

It is active when the generation spans more than one host, at least one host runs more than
one rank, the generation has shards (node-local ones: without them there is no host shard to
combine on) and ``hierarchical`` is on (``GRADSTAR_HIERARCHICAL=0`` turns it off).
"""

from __future__ import annotations

from .layout import HostPlan, plan
from .programs import Program, Stage
from .two_level import HostHierarchy

__all__ = ["HostHierarchy", "HostPlan", "Program", "Stage", "plan"]
