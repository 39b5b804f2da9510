"""The coordinator's relay of peer streams to ranks on hosts that take no inbound connections
(:mod:`.servicer`); the rank's half is :mod:`gradstar.client.peer.relay`, what both agree on
:mod:`gradstar.transport.relay`."""

from .servicer import RelayServicer

__all__ = ["RelayServicer"]
