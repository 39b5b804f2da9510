"""Process groups: the rank's handle on its job. ``AsyncProcessGroup`` does the work;
``ProcessGroup`` runs it on a private event-loop thread for blocking code.

Every collective takes its sequence number when it is *called*, not when it is awaited, so
collectives issued in the same order on every rank match on the hub even when several run
concurrently (``async_op=True`` or ``asyncio.gather``).

The modules: :mod:`.group` (the asyncio group: joining and connecting, collectives through the
hub, life cycle), :mod:`.point_to_point` (send, recv and all_to_all over peer streams, mixed
into it), :mod:`.join` (:func:`init_process_group_async`: the settings from arguments and
environment) and :mod:`.blocking` (the blocking facade and :func:`init_process_group`).
"""

from .blocking import ProcessGroup, init_process_group
from .group import AsyncProcessGroup
from .join import init_process_group_async

__all__ = [
    "AsyncProcessGroup",
    "ProcessGroup",
    "init_process_group",
    "init_process_group_async",
]
