"""gradstar.coordinator: the hub — rendezvous, collective engine, admin and health."""

from .embedded import EmbeddedCoordinator
from .server import Coordinator

__all__ = ["Coordinator", "EmbeddedCoordinator"]
