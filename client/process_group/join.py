"""Joining a job: :func:`init_process_group_async` takes its settings from the arguments, then
the ``GRADSTAR_*`` variables (and a token file), checks them and hands them to
:func:`open_group`, which joins the job's generation,
connects to its data plane and, when the generation spans hosts, joins the groups of the
two-level all_reduce (:mod:`gradstar.client.hierarchy`).
"""

from __future__ import annotations

import asyncio
import functools
import time

from gradstar.allocator import tune_allocator
from gradstar.config import ClientSettings
from gradstar.errors import (
    ConfigurationError,
    CoordinatorUnavailableError,
    GradstarError,
    LeadershipError,
)
from gradstar.transport.channels import call_metadata
from gradstar.transport.tls_check import wait_connected

from ..coordinators import REACH_S, Coordinators
from ..peer import PeerEndpoint
from ..reconnect import RETRY_PAUSE
from ..session import Session
from .group import AsyncProcessGroup
from .membership import Membership


def _settings(**given) -> ClientSettings:
    settings = ClientSettings(**{k: v for k, v in given.items() if v is not None})
    if settings.world_size is None:
        raise ConfigurationError(
            "world_size is required: pass world_size= or set GRADSTAR_WORLD_SIZE"
        )
    return settings.with_token()


async def init_process_group_async(
    coordinator: str | None = None, job: str | None = None, world_size: int | None = None,
    rank: int | None = None, token: str | None = None, *, peer_address: str = "", **options,
) -> AsyncProcessGroup:
    """Join ``job`` on the coordinator and wait for every rank; return the rank's group.

    Arguments left as None come from ``GRADSTAR_COORDINATOR``, ``GRADSTAR_JOB``,
    ``GRADSTAR_WORLD_SIZE``, ``GRADSTAR_RANK`` and ``GRADSTAR_TOKEN``. ``options`` are further
    :class:`~gradstar.config.ClientSettings` fields (``timeout``, ``join_timeout``, ``tls_ca``,
    ``chunk_bytes``, ...). ``rank=None`` lets the coordinator assign one. The rank's peer server
    (send/recv) binds ``peer_host``:``peer_port`` and registers its address in the peer table;
    ``peer_address`` overrides the address registered (NAT, a name the others resolve).

    Raises:
        ConfigurationError: a missing or invalid setting.
        CoordinatorUnavailableError: the coordinator or a hub shard of the generation could
            not be reached within ``connect_timeout`` seconds (a TLS mismatch: at once, named).
        AuthenticationError: the coordinator refused the token.
        RendezvousError and subclasses: duplicate rank, world-size disagreement, join timeout.
    """
    try:
        settings = _settings(coordinator=coordinator, job=job, world_size=world_size, rank=rank,
                             token=token, **options)
    except ValueError as error:
        if isinstance(error, GradstarError):
            raise
        raise ConfigurationError(f"invalid process group settings: {error}") from None
    if settings.tune_allocator:
        tune_allocator()
    group = await open_group(settings, peer_address, membership=Membership(settings.timeout))
    group.peer_address_given = peer_address
    return group


async def open_group(settings: ClientSettings, peer_address: str = "", *,
                     peers: bool = True, moving_from=None, membership=None) -> AsyncProcessGroup:
    """Join ``settings.job``, connect to its data plane and, with ``peers``, join the groups of
    its two-level all_reduce (``peers=False``: without a peer server, for those groups of
    :mod:`gradstar.client.hierarchy`). What fails on the way is closed again.
    ``moving_from`` (``MovingFrom``): join the job's next generation at a resize's boundary;
    ``membership``: this rank's :class:`~.membership.Membership`, told of the generation."""
    coordinators = Coordinators(settings)
    # One address from here on (the first until the join finds the leader, under --ha).
    settings = settings.model_copy(update={"coordinator": coordinators.current})
    peer_endpoint = PeerEndpoint(settings, call_metadata(settings)) if peers else None
    session = Session(coordinators, call_metadata(settings), settings.reconnect_timeout)
    try:
        if peer_endpoint is not None:
            peer_address = await peer_endpoint.start(peer_address)
        session.membership = membership  # told of the generation as the join answers
        await _join_leader(session, settings, functools.partial(
            session.join, settings.job, settings.world_size, settings.rank, peer_address,
            settings.join_timeout, settings.elastic, outbound_only=settings.outbound_only,
            punch_port=peer_endpoint.punch_port if peer_endpoint is not None else 0,
            max_world_size=settings.max_world_size or 0,
            min_world_size=settings.min_world_size or 0, moving_from=moving_from))
    except BaseException:
        await coordinators.close()
        if peer_endpoint is not None:
            await peer_endpoint.close()
        raise
    settings = settings.model_copy(update={"coordinator": session.target})
    group = AsyncProcessGroup(settings, session.channel, session, peer_endpoint,
                              functools.partial(_subgroup, settings))
    try:
        await group.connect(hosts=peers)
    except BaseException:
        await group.close()
        raise
    return group


async def _join_leader(session: Session, settings: ClientSettings, join) -> None:
    """``join()`` on the coordinator that leads: the one address given, or the first of several
    (coordinators under --ha) that takes it, for up to ``connect_timeout`` seconds; a standby
    refuses it naming the leader, which is tried next.

    Raises:
        CoordinatorUnavailableError: none took it in time (each one's answer named).
        What ``join()`` raises otherwise.
    """
    coordinators = session.coordinators
    tls = settings.tls_ca, settings.tls_cert, settings.tls_key
    if not coordinators.several:
        await wait_connected(session.channel, session.target, settings.connect_timeout, *tls)
        await join()
        return
    deadline = time.monotonic() + settings.connect_timeout
    answers: dict[str, str] = {}
    while (left := deadline - time.monotonic()) > 0:
        connected = False
        try:
            await wait_connected(session.channel, session.target, min(left, REACH_S), *tls)
            connected = True
            await join()
            return
        except (CoordinatorUnavailableError, LeadershipError) as error:
            answers[session.target] = f"{type(error).__name__}: {error}"
            if connected and isinstance(error, CoordinatorUnavailableError):
                # The leader took the join and went away while it waited for the other ranks:
                # the next leader gets a whole connect_timeout from now.
                deadline = time.monotonic() + settings.connect_timeout
            following = coordinators.after(session.target, getattr(error, "leader", ""))
            if following == coordinators.addresses[0]:
                await asyncio.sleep(RETRY_PAUSE)  # each one tried: a new leader takes time
            session.use(following)
    raise CoordinatorUnavailableError(
        f"none of the coordinators {', '.join(coordinators.addresses)} took the join of job "
        f"{settings.job!r} within connect_timeout ({settings.connect_timeout:g} s): "
        + "; ".join(f"{a}: {why}" for a, why in answers.items()))


async def _subgroup(settings: ClientSettings, job: str, world_size: int,
                    rank: int) -> AsyncProcessGroup:
    """Join ``job``, one of the groups of :mod:`gradstar.client.hierarchy`, as this rank's main
    settings say (coordinator, token, TLS, timeouts), without a peer server: it runs collectives
    only."""
    return await open_group(settings.model_copy(update={"job": job, "world_size": world_size,
                                                        "rank": rank}), peers=False)


__all__ = ["init_process_group_async", "open_group"]
