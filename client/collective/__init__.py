"""The rank's half of the Collective stream: the mirror of :mod:`gradstar.coordinator.collective`.

:mod:`.stream` is the I/O (the hub's twin is :mod:`gradstar.coordinator.collective.servicer`),
:mod:`.plan` the rank's part in one collective and its incoming stream without sockets (the
hub's twin is :mod:`gradstar.coordinator.collective.engine`), :mod:`.targets` where the streams
go and how they stay open between collectives, and :mod:`.data_plane` a generation's targets
(the coordinator, or its hub shards) and the chunk size per stripe.
"""

from .data_plane import DataPlane, resolve, striped_chunk_bytes
from .plan import CollectivePlan, Phase, StreamReceiver
from .stream import abandon_collective, give_up, issue, run_collective, run_stream
from .targets import OpenStream, SharedMemoryOffer, Target

__all__ = [
    "CollectivePlan",
    "DataPlane",
    "OpenStream",
    "Phase",
    "SharedMemoryOffer",
    "StreamReceiver",
    "Target",
    "abandon_collective",
    "give_up",
    "issue",
    "resolve",
    "run_collective",
    "run_stream",
    "striped_chunk_bytes",
]
