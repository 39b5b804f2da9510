"""A sharded hub's data plane: the shard processes and the coordinator's table of them.

:mod:`.shard` is one shard process (``gradstar shard``: the Collective stream for its stripes),
:mod:`.registry` the coordinator's side (which shards exist, which generation stripes over which,
the ShardControl stream) and :mod:`.local` the shard processes the coordinator starts on its own
host (``--shards K``). A node-local shard started beside a host's ranks is
:mod:`gradstar.node_shard`'s (ranks and agents start it, so it lives in the shared core).
"""

from .local import LocalShards
from .registry import ShardControlServicer, ShardRecord, ShardRegistry
from .shard import Shard

__all__ = [
    "LocalShards",
    "Shard",
    "ShardControlServicer",
    "ShardRecord",
    "ShardRegistry",
]
