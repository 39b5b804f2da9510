"""The coordinators a rank may be served by, and which of them leads.

``GRADSTAR_COORDINATOR`` (``coordinator=``) is one address, or several separated by commas:
coordinators started with ``--ha``, one of which leads while the others stand by
(:mod:`gradstar.coordinator.leadership`). A rank joins the one that leads and, when it goes
away, rejoins whichever leads next (:mod:`.reconnect`); a standby refuses it with
:class:`~gradstar.errors.NotLeaderError`, naming the leader, which the rank tries next.

Each leader has a term, which only grows; the rank keeps the highest it has seen
(:attr:`Coordinators.term`) and refuses a coordinator of an older one
(:class:`~gradstar.errors.StaleCoordinatorError`): a leader that lost its lease while it was
stopped or cut off, and woke up after another took over.

One address (a DNS name or a Kubernetes Service in front of the replicas included) works the
same way, with one address to try.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from gradstar.config import ClientSettings
from gradstar.errors import ConfigurationError, StaleCoordinatorError
from gradstar.proto.v1 import rendezvous_pb2 as rpb
from gradstar.transport.channels import open_channel

log = logging.getLogger(__name__)

#: How long a rank that knows of several coordinators waits for one to take its connection
#: before it tries the next (one that was stopped takes connections but never answers).
REACH_S = 1.0


def addresses_of(setting: str) -> list[str]:
    """The addresses of a ``coordinator`` setting (``HOST:PORT[,HOST:PORT...]``), in order.

    Raises:
        ConfigurationError: no address in it, or one named twice.
    """
    addresses = [a.strip() for a in setting.split(",") if a.strip()]
    if not addresses:
        raise ConfigurationError(
            f"coordinator {setting!r} names no address: give HOST:PORT, or several separated "
            "by commas (coordinators under --ha)")
    if len(set(addresses)) != len(addresses):
        raise ConfigurationError(f"coordinator {setting!r} names an address twice")
    return addresses


class Coordinators:
    """The addresses of ``settings.coordinator``, a channel to each (opened when first used),
    which one this rank uses, and the highest leadership term it has seen."""

    def __init__(self, settings: ClientSettings, *, bulk: bool = False) -> None:
        self.addresses = addresses_of(settings.coordinator)
        self._settings = settings
        self._bulk = bulk  # channels for tensors (gradstar.transport.channels)
        self._channels: dict[str, grpc.aio.Channel] = {}
        #: The address this rank uses now (the leader, once it joined).
        self.current = self.addresses[0]
        #: The highest leadership term of a coordinator that took this rank (0: none, or a
        #: coordinator without --ha).
        self.term = 0

    @property
    def several(self) -> bool:
        return len(self.addresses) > 1

    def channel(self, address: str) -> grpc.aio.Channel:
        """The channel to ``address`` (one per address, kept until :meth:`close`)."""
        if address not in self._channels:
            self._channels[address] = open_channel(self._settings, address, bulk=self._bulk)
        return self._channels[address]

    def after(self, address: str, leader: str = "") -> str:
        """The address to try after ``address`` refused or did not answer: the ``leader`` it
        named if that is one of ours, else the next in the list."""
        if leader in self.addresses and leader != address:
            return leader
        return self.addresses[(self.addresses.index(address) + 1) % len(self.addresses)]

    def accept(self, joined: rpb.Joined, address: str) -> None:
        """Take the coordinator at ``address`` that answered ``joined``, unless its term is
        older than one this rank has seen.

        Raises:
            StaleCoordinatorError: it is; nothing of its answer may be used.
        """
        if joined.term < self.term:
            raise StaleCoordinatorError(
                f"the coordinator at {address} leads in term {joined.term}, but this rank was "
                f"taken by a leader of term {self.term} already: it lost its lease since and "
                "must not serve; looking for the current leader", term=joined.term,
                seen=self.term)
        self.term, self.current = joined.term, address

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels))


__all__ = ["REACH_S", "Coordinators", "addresses_of"]
