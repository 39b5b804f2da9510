"""gradstar.client: what a training process uses to talk to the coordinator."""

from .process_group import (
    AsyncProcessGroup,
    ProcessGroup,
    init_process_group,
    init_process_group_async,
)
from .work import Work

__all__ = [
    "AsyncProcessGroup",
    "ProcessGroup",
    "Work",
    "init_process_group",
    "init_process_group_async",
]
