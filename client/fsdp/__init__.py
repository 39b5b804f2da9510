"""Fully sharded data parallelism: :class:`FullyShardedDataParallel` (:mod:`.wrapper`), its
units (:mod:`.plan` decides them, :mod:`.unit` and :mod:`.flat_param` hold them), the gather and
reduce-scatter schedule around forward and backward (:mod:`.runtime`, its records in
:mod:`.records`, branches in :mod:`.unused`) and checkpoints (:mod:`.state_dict`)."""

from .state_dict import full_state_dict_from_shards
from .wrapper import FSDP, FullyShardedDataParallel

__all__ = ["FSDP", "FullyShardedDataParallel", "full_state_dict_from_shards"]
