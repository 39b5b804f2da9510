"""Single-process data parallelism over several local devices: :class:`DataParallel`
(:mod:`.wrapper`), the devices it accepts (:mod:`.devices`), how a batch is split and the
outputs joined (:mod:`.scatter`), and the per-forward replicas run on threads
(:mod:`.replicas`)."""

from .replicas import parallel_apply, replicate
from .scatter import gather, scatter
from .wrapper import DataParallel

__all__ = ["DataParallel", "gather", "parallel_apply", "replicate", "scatter"]
