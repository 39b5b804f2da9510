"""gradstar: data-, shard- and pipeline-parallel training over a gRPC star.

    import gradstar
    with gradstar.init_process_group(coordinator="host:29400", job="j", world_size=4) as pg:
        total = pg.all_reduce(x, op="sum")
"""

import os

# grpc's C core logs INFO lines (connection GOAWAYs and the like) to stderr by default; they mean
# nothing to a user and drown real errors. Quiet unless the user asks (GRPC_VERBOSITY=INFO/DEBUG);
# read by grpc when it starts, so set before anything here imports it.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from gradstar import errors
from gradstar.client import (
    AsyncProcessGroup,
    LocalSGD,
    ProcessGroup,
    StreamingDiLoCo,
    Work,
    init_process_group,
    init_process_group_async,
)
from gradstar.errors import GradstarError
from gradstar.sync_modes import Asynchronous, BoundedStaleness, Quorum, Synchronous

__version__ = "0.1.0"

__all__ = [
    "DDP",
    "FSDP",
    "AsyncProcessGroup",
    "Asynchronous",
    "BoundedStaleness",
    "DataParallel",
    "DistributedDataParallel",
    "FullyShardedDataParallel",
    "GradstarError",
    "LocalSGD",
    "Pipeline",
    "ProcessGroup",
    "Quorum",
    "StreamingDiLoCo",
    "Synchronous",
    "Work",
    "__version__",
    "create_distributed_data_parallel",
    "errors",
    "init_process_group",
    "init_process_group_async",
]


def __getattr__(name: str):
    # DistributedDataParallel imports torch (optional): resolved lazily, see gradstar.client.
    if name in ("DistributedDataParallel", "DDP", "Pipeline", "FullyShardedDataParallel",
                "FSDP", "DataParallel", "create_distributed_data_parallel"):
        from gradstar import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# `import gradstar` makes backend "gradstar" known to torch.distributed, without importing torch
# (optional, and slow to import): at once if torch is imported, else right after it is.
from gradstar.client.torch_import_hook import install as _install_torch_backend  # noqa: E402

_install_torch_backend()
