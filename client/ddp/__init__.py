"""gradstar.DDP: data parallelism over the hub, torch's DistributedDataParallel for gradstar.

``wrapper`` holds the nn.Module and its options, ``reducer`` the gradient buckets and what one
synchronisation does with them, ``inputs`` the move of a forward's inputs to the module's device,
``create`` the one-call constructor (join the job and wrap).
"""

from ..buckets import BucketLaunch, StepTimeline
from .create import create_distributed_data_parallel
from .wrapper import DDP, DistributedDataParallel

__all__ = ["DDP", "BucketLaunch", "DistributedDataParallel", "StepTimeline",
           "create_distributed_data_parallel"]
