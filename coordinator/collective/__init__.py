"""The hub's half of the Collective stream: the mirror of :mod:`gradstar.client.collective`.

:mod:`.servicer` is the gRPC edge (raw frames in and out; the rank's twin is
:mod:`gradstar.client.collective.stream`), :mod:`.engine` the life of one collective without
sockets (the rank's twin is :mod:`gradstar.client.collective.plan`), :mod:`.window` a rank's
side of it and the read window, :mod:`.matching` the header checks, :mod:`.reduce` the chunk
reducers, :mod:`.budget` the hub's memory budget for collectives and :mod:`.deadlines` their
timeouts.
"""

from .budget import CollectiveBudget
from .engine import CollectiveEngine, PendingCollective
from .matching import Limits
from .reduce import BufferPool
from .servicer import CollectiveServicer
from .window import Participant, ReadWindow

__all__ = [
    "BufferPool",
    "CollectiveBudget",
    "CollectiveEngine",
    "CollectiveServicer",
    "Limits",
    "Participant",
    "PendingCollective",
    "ReadWindow",
]
