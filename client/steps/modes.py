"""The sync-mode face of :class:`~gradstar.client.ddp.DistributedDataParallel`: choosing a mode,
synchronizing, weights and statistics. DDP inherits it; the ledger modes' work is done by
:class:`~.sync.StepSync`, made at the first of them."""

from __future__ import annotations

import math

from gradstar.errors import ConfigurationError
from gradstar.sync_modes import SyncMode, check_mode
from gradstar.wire.formats import wire_format


class SyncModes:
    """Mixed into DDP, which owns ``sync_mode``, ``_steps``, ``_weight``, ``_optimizer``,
    ``_params``, ``process_group``, ``wire`` and ``gradient_compression``."""

    def set_sync_mode(self, mode: SyncMode) -> None:
        """Switch sync mode (every rank, between steps): leaving or changing a ledger mode
        synchronizes first, so every rank switches at the same step.

        Raises:
            ConfigurationError: not a sync mode; a mode other than Synchronous without
                ``optimizer=``; Synchronous with a ``wire`` format and a contribution weight.
        """
        mode = check_mode(mode)
        if not mode.on_ledger and self.wire is not None and self._weight is not None:
            raise ConfigurationError(_SYNCHRONOUS_WEIGHTS)
        if self.sync_mode.on_ledger and mode.on_ledger:
            self._steps.set_mode(mode)
        elif self.sync_mode.on_ledger:
            self._steps.synchronize()
            self._steps.detach()
        elif mode.on_ledger:
            self._steps = self._steps or _step_sync(self, mode)
            self._steps.attach(mode)
        self.sync_mode = mode

    def synchronize(self) -> None:
        """Every rank: wait until every gradient sent so far is aggregated and applied, so the
        replicas are bitwise identical (before evaluating, checkpointing, at the end).
        Synchronous steps are always complete: nothing to do.

        Raises:
            StepTimeoutError: the other live ranks did not arrive in time.
        """
        if self.sync_mode.on_ledger:
            self._steps.synchronize()

    @property
    def contribution_weight(self) -> float:
        """Weight of this rank's gradients in their step's weighted mean (e.g. its samples per
        step; default 1). In Synchronous mode, set it on every rank or none: a weighted step
        all_reduces sums and the weights' sum instead of means, and not with a ``wire`` format
        (in the other modes the weight travels beside the gradient, with any format)."""
        return 1.0 if self._weight is None else self._weight

    @contribution_weight.setter
    def contribution_weight(self, weight: float) -> None:
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not (
                math.isfinite(weight)) or weight < 0:
            raise ConfigurationError(f"contribution_weight={weight!r}: a weight is a finite "
                                     "number >= 0 (e.g. this rank's samples in the step)")
        if self.wire is not None and not self.sync_mode.on_ledger:
            raise ConfigurationError(_SYNCHRONOUS_WEIGHTS)
        self._weight = float(weight)

    @property
    def contribution_residual(self):
        """In a sync mode other than Synchronous with error feedback: what this rank's
        contributions lost to the wire format so far (one flat float32 tensor over the
        parameters in DDP's order; read only). None otherwise, or before the first one."""
        return None if self._steps is None else self._steps.residual

    def sync_stats(self):
        """What this rank saw of its sync mode (:class:`~.stats.SyncStats`: steps applied,
        gradients dropped, staleness); None before any mode other than Synchronous."""
        return None if self._steps is None else self._steps.stats


_SYNCHRONOUS_WEIGHTS = (
    "contribution weights are not carried with a wire format in Synchronous mode (its buckets "
    "all_reduce w*g in the format, which error feedback does not compensate); the other sync "
    "modes carry them")


def _step_sync(ddp, mode: SyncMode):
    """The ledger driver of ``ddp`` (made at its first ledger mode): contributions travel in
    its ``wire`` format with its error feedback, or in its ``gradient_compression`` dtype's
    format ('bf16', 'fp16') without, as that rounds in Synchronous."""
    from .sync import StepSync

    name = ddp.wire or ddp.gradient_compression
    return StepSync(ddp.module, ddp._params, ddp._optimizer, ddp.process_group, mode, "ddp",
                    wire=None if name is None else wire_format(name), feedback=ddp.reducer.feedback,
                    buffers=list(ddp.module.buffers()) if ddp.broadcast_buffers else [])
