"""The sync mode of a :class:`~gradstar.client.ddp.DistributedDataParallel`:
:class:`SyncModeState`, the object a DDP owns for it (the mode in effect, the contribution
weight, the ledger modes' driver :class:`~.sync.StepSync`, made at the first of them), given
at construction what that driver needs of the DDP. DDP's ``set_sync_mode``,
``synchronize``, ``contribution_weight``, ``contribution_residual`` and ``sync_stats``
delegate to it; their docstrings there are the contract."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from gradstar.errors import ConfigurationError
from gradstar.sync_modes import Synchronous, SyncMode, check_mode
from gradstar.wire.formats import wire_format

from ..error_feedback import ErrorFeedback
from ..process_group.protocol import CollectiveGroup

if TYPE_CHECKING:
    from .stats import SyncStats
    from .sync import StepSync


class SyncModeState:
    """A DDP's sync mode (see the module docstring). ``module``, ``params`` (trainable, in
    DDP's order), ``optimizer`` and ``pg`` are the DDP's; contributions of the ledger modes
    travel in the ``wire`` format with ``feedback`` (its error feedback), or in the
    ``compression`` dtype's format ('bf16', 'fp16') without, as that rounds in Synchronous;
    ``broadcast_buffers``: the module's buffers travel with each contribution."""

    def __init__(self, module: nn.Module, params: list[torch.Tensor],
                 optimizer: torch.optim.Optimizer | None, pg: CollectiveGroup, *,
                 wire: str | None, compression: str | None, feedback: ErrorFeedback | None,
                 broadcast_buffers: bool) -> None:
        self._module = module
        self._params = params
        self._optimizer = optimizer
        self._pg = pg
        self._wire = wire
        self._compression = compression
        self._feedback = feedback
        self._broadcast_buffers = broadcast_buffers
        #: The mode in effect.
        self.mode: SyncMode = Synchronous()
        #: The ledger modes' driver, made at the first of them; None before.
        self.steps: StepSync | None = None
        #: The contribution weight set; None: plain means.
        self.weight: float | None = None

    def set(self, mode: SyncMode) -> None:
        """As :meth:`DistributedDataParallel.set_sync_mode`."""
        mode = check_mode(mode)
        if not mode.on_ledger and self._wire is not None and self.weight is not None:
            raise ConfigurationError(_SYNCHRONOUS_WEIGHTS)
        if self.mode.on_ledger and mode.on_ledger:
            self.steps.set_mode(mode)
        elif self.mode.on_ledger:
            self.steps.synchronize()
            self.steps.detach()
        elif mode.on_ledger:
            self.steps = self.steps or self._step_sync(mode)
            self.steps.attach(mode)
        self.mode = mode

    def synchronize(self) -> None:
        """As :meth:`DistributedDataParallel.synchronize`."""
        if self.mode.on_ledger:
            self.steps.synchronize()

    def set_weight(self, weight: float) -> None:
        """As the setter of :attr:`DistributedDataParallel.contribution_weight`."""
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not (
                math.isfinite(weight)) or weight < 0:
            raise ConfigurationError(f"contribution_weight={weight!r}: a weight is a finite "
                                     "number >= 0 (e.g. this rank's samples in the step)")
        if self._wire is not None and not self.mode.on_ledger:
            raise ConfigurationError(_SYNCHRONOUS_WEIGHTS)
        self.weight = float(weight)

    @property
    def residual(self) -> torch.Tensor | None:
        """As :attr:`DistributedDataParallel.contribution_residual`."""
        return None if self.steps is None else self.steps.residual

    @property
    def stats(self) -> SyncStats | None:
        """As :meth:`DistributedDataParallel.sync_stats`."""
        return None if self.steps is None else self.steps.stats

    def _step_sync(self, mode: SyncMode) -> StepSync:
        from .sync import StepSync

        name = self._wire or self._compression
        return StepSync(self._module, self._params, self._optimizer, self._pg, mode, "ddp",
                        wire=None if name is None else wire_format(name),
                        feedback=self._feedback,
                        buffers=list(self._module.buffers()) if self._broadcast_buffers else [])


_SYNCHRONOUS_WEIGHTS = (
    "contribution weights are not carried with a wire format in Synchronous mode (its buckets "
    "all_reduce w*g in the format, which error feedback does not compensate); the other sync "
    "modes carry them")


__all__ = ["SyncModeState"]
