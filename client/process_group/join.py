"""Joining a job: :func:`init_process_group_async` takes its settings from the arguments, then
the ``GRADSTAR_*`` variables (and a token file), checks them and hands them to
:func:`~gradstar.client.process_group.group.open_group`, which joins the job's generation,
connects to its data plane and, when the generation spans hosts, joins the groups of the
two-level all_reduce (:mod:`gradstar.client.hierarchy`).
"""

from __future__ import annotations

from pydantic import SecretStr

from gradstar.allocator import tune_allocator
from gradstar.config import ClientSettings
from gradstar.errors import ConfigurationError, GradstarError

from .group import AsyncProcessGroup, open_group


def _settings(**given) -> ClientSettings:
    settings = ClientSettings(**{k: v for k, v in given.items() if v is not None})
    if settings.world_size is None:
        raise ConfigurationError(
            "world_size is required: pass world_size= or set GRADSTAR_WORLD_SIZE"
        )
    if settings.token is None and settings.token_file is not None:
        try:
            token = settings.token_file.read_text(encoding="utf-8").strip()
        except OSError as error:
            raise ConfigurationError(f"cannot read the token file {settings.token_file}: "
                                     f"{error.strerror}") from None
        if not token:  # an empty token would mean "no authentication": never by accident
            raise ConfigurationError(f"the token file {settings.token_file} is empty")
        settings.token = SecretStr(token)
    return settings


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
    return await open_group(settings, peer_address)


__all__ = ["init_process_group_async"]
