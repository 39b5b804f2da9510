"""gradstar.client: what a training process uses to talk to the coordinator."""

from .outer import LocalSGD, StreamingDiLoCo
from .process_group import (
    AsyncProcessGroup,
    ProcessGroup,
    init_process_group,
    init_process_group_async,
)
from .work import Work

__all__ = [
    "DDP",
    "FSDP",
    "AsyncProcessGroup",
    "DataParallel",
    "DistributedDataParallel",
    "FullyShardedDataParallel",
    "LocalSGD",
    "Pipeline",
    "ProcessGroup",
    "StreamingDiLoCo",
    "Work",
    "create_distributed_data_parallel",
    "init_process_group",
    "init_process_group_async",
]


def __getattr__(name: str):
    # DDP needs torch, which is optional (numpy users install gradstar without it): import it
    # on first use so `import gradstar` works without torch.
    if name in ("DistributedDataParallel", "DDP", "create_distributed_data_parallel"):
        from . import ddp

        return getattr(ddp, name)
    if name in ("FullyShardedDataParallel", "FSDP"):
        from . import fsdp

        return getattr(fsdp, name)
    if name == "DataParallel":
        from .data_parallel import DataParallel

        return DataParallel
    if name == "Pipeline":
        from .pipeline import Pipeline

        return Pipeline
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
