"""gradstar.coordinator: the hub — rendezvous, collective engine, admin and health."""

from .server import Coordinator

__all__ = ["Coordinator"]
