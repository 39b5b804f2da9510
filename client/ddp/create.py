"""The one-call constructor: join the job and wrap the model, for scripts that need no process
group of their own (``gradstar launch`` sets the GRADSTAR_* variables it reads)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from gradstar.errors import ConfigurationError

from ..process_group import init_process_group
from .wrapper import DistributedDataParallel


def create_distributed_data_parallel(
    model: nn.Module, coordinator: str | None = None, job: str | None = None,
    world_size: int | None = None, rank: int | None = None, token: str | None = None, *,
    pg_options: Mapping[str, Any] | None = None, **ddp_options: Any,
) -> DistributedDataParallel:
    """Join the job and wrap ``model``: :func:`gradstar.init_process_group` with the job
    arguments, then :class:`DistributedDataParallel` over that group, on the model's device
    (CPU or one CUDA device, as DDP takes it; nothing else to pass).

    Same training as those two calls::

        model = gradstar.create_distributed_data_parallel(net, bucket_cap_mb=10)
        ...
        model.process_group.close()   # every rank, at the end

    The wrapper's ``process_group`` is the group joined here; closing it is the caller's, as
    with a group it joined itself. If the wrapper cannot be built, the group is closed again.

    Args:
        model: the module to wrap (as DDP's ``module``).
        coordinator: as :func:`gradstar.init_process_group` (None: GRADSTAR_COORDINATOR).
        job: as :func:`gradstar.init_process_group` (None: GRADSTAR_JOB).
        world_size: as :func:`gradstar.init_process_group` (None: GRADSTAR_WORLD_SIZE).
        rank: as :func:`gradstar.init_process_group` (None: GRADSTAR_RANK).
        token: as :func:`gradstar.init_process_group` (None: GRADSTAR_TOKEN).
        pg_options: further process-group settings (``timeout``, ``join_timeout``, ...), the
            keyword arguments :func:`gradstar.init_process_group` takes.
        **ddp_options (Any): DDP's keyword arguments (``bucket_cap_mb``,
            ``find_unused_parameters``, ``sync_mode``, ``optimizer``, ...).

    Raises:
        ConfigurationError: ``model`` is not a torch.nn.Module (before joining), a setting is
            invalid, or DDP refuses the model or an option.
        CoordinatorUnavailableError, AuthenticationError, RendezvousError: joining failed.
        CollectiveError and subclasses: DDP's initial broadcast failed.
    """
    if not isinstance(model, nn.Module):
        raise ConfigurationError(
            f"create_distributed_data_parallel wraps a torch.nn.Module, got "
            f"{type(model).__name__}; nothing was joined")
    pg = init_process_group(coordinator, job, world_size, rank, token, **(pg_options or {}))
    try:
        return DistributedDataParallel(model, pg, **ddp_options)
    except BaseException:
        pg.close()  # the caller never got the group, so nobody else could close it
        raise


__all__ = ["create_distributed_data_parallel"]
