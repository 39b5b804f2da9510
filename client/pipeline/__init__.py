"""Pipeline parallelism: :class:`Pipeline` (the stage wrapper), its schedules (GPipe, 1F1B) and
its activation meter. The protocol every stage follows is in :mod:`.pipeline`."""

from .memory import ActivationMeter
from .pipeline import Pipeline
from .schedules import SCHEDULES, schedule_actions, split_sizes

__all__ = ["SCHEDULES", "ActivationMeter", "Pipeline", "schedule_actions", "split_sizes"]
