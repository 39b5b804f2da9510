"""gradstar: data-, shard- and pipeline-parallel training over a gRPC star.

    import gradstar
    with gradstar.init_process_group(coordinator="host:29400", job="j", world_size=4) as pg:
        total = pg.all_reduce(x, op="sum")
"""

from gradstar import errors
from gradstar.client import (
    AsyncProcessGroup,
    ProcessGroup,
    Work,
    init_process_group,
    init_process_group_async,
)
from gradstar.errors import GradstarError

__version__ = "0.1.0"

__all__ = [
    "AsyncProcessGroup",
    "GradstarError",
    "ProcessGroup",
    "Work",
    "__version__",
    "errors",
    "init_process_group",
    "init_process_group_async",
]
