"""Outer optimisation: ranks or replicas train apart for a while, then meet at the hub.

:mod:`.local_sgd` is LocalSGD and DiLoCo (parameter averaging through the hub's global model,
over the process group), :mod:`.streaming_diloco` Streaming DiLoCo (fragments on staggered,
overlapped, fault-tolerant outer rounds), :mod:`.plan` its fragments and schedule (no I/O) and
:mod:`.rounds` the replica's half of the Rounds service (the hub's is
:mod:`gradstar.coordinator.rounds`).
"""

from .local_sgd import LocalSGD
from .plan import Schedule, split_fragments
from .rounds import RoundPolicySpec, RoundsClient
from .streaming_diloco import StreamingDiLoCo

__all__ = [
    "LocalSGD",
    "RoundPolicySpec",
    "RoundsClient",
    "Schedule",
    "StreamingDiLoCo",
    "split_fragments",
]
