"""gradstar.coordinator: the hub — rendezvous, collective engine, rounds, shards, admin and health.

Its rooms: :mod:`.rendezvous` (jobs, generations, members), :mod:`.collective` (the Collective
stream: servicer, engine, window, matching, reduce, budget), :mod:`.rounds` (fault-tolerant
rounds and the averaging store), :mod:`.shards` (the data-plane shard processes and their
registry), :mod:`.views` (Admin service, status page); beside them :mod:`.metrics` (Prometheus,
observed by the engine, read by the views), :mod:`.server` (the grpc.aio server that wires them)
and :mod:`.embedded` (a coordinator on a thread).
"""

from .embedded import EmbeddedCoordinator
from .server import Coordinator

__all__ = ["Coordinator", "EmbeddedCoordinator"]
