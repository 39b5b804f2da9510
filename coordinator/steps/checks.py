"""Whether a contribution may join a ledger, decided from its header alone, before its data
is read: the checks never change the ledger (see :mod:`.ledger` for the protocol). The
ledger calls them, so ``ledger`` is a :class:`~.ledger.StepLedger` that this module does not
import."""

from __future__ import annotations

import math

from gradstar.errors import HubCapacityError, ProtocolError, StepMismatchError
from gradstar.sync_modes import SyncMode
from gradstar.wire.formats import format_from_wire


def check_header(ledger, rank: int, mode: SyncMode, mode_epoch: int, numel: int,
                 base: int, weight: float, wire: int, hyper: tuple[float, ...], buffers: int,
                 max_numel: int) -> None:
    """Refuse a contribution to ``ledger`` before its data is read; this never changes the
    ledger (a refused header leaves its mode, epoch and size as they were).

    Raises:
        StepMismatchError: a bad weight, a base from the future, another size, mode or
            wire format than the ledger's, a duplicate in the open step.
        HubCapacityError: the gradient is over the hub's size limit.
        ProtocolError: an unknown wire format.
    """
    who = f"rank {rank} of job {ledger.job!r}"
    if reason := wire_mismatch(ledger, wire) or hyper_mismatch(ledger, hyper):
        raise StepMismatchError(f"{who} {reason}")
    if not math.isfinite(weight) or weight < 0:
        raise StepMismatchError(f"{who} sent a contribution of weight {weight}; a weight "
                                "is a finite number >= 0 (e.g. its number of samples)")
    if numel > max_numel:
        raise HubCapacityError(
            f"{who} sent a gradient of {numel} float32 values, over this coordinator's "
            f"limit of {max_numel} (--max-tensor-bytes)")
    if ledger.numel is not None and numel != ledger.numel:
        raise StepMismatchError(f"{who} sent {numel} gradient values to model "
                                f"{ledger.model!r}, whose gradients have {ledger.numel}")
    if buffers > numel or (ledger.numel is not None and buffers != ledger.buffer_numel):
        raise StepMismatchError(f"{who} sent {buffers} buffer values of {numel} to model "
                                f"{ledger.model!r}, whose contributions carry "
                                f"{ledger.buffer_numel}; every rank must send the same buffers")
    if base > ledger.steps:
        raise StepMismatchError(f"{who} contributed a gradient computed after {base} "
                                f"aggregates, but only {ledger.steps} steps closed")
    check_mode(ledger, who, mode, mode_epoch)
    if rank in ledger.open.contributions and not (ledger.mode is not None and ledger.mode.pushes):
        raise StepMismatchError(f"{who} contributed twice to step {ledger.open.number}; "
                                "apply the aggregates (optimizer.step()) between backward "
                                "passes")


def check_mode(ledger, who: str, mode: SyncMode, epoch: int) -> None:
    """A contribution's mode must be the ledger's, at the ledger's epoch; the first one of
    a ledger names its mode (at epoch 0, or the epoch the ledger resumed at). Only a barrier
    switches (``StepsTable.synchronize``); this never changes the ledger."""
    if epoch != ledger.mode_epoch or (ledger.mode is not None and mode != ledger.mode):
        steps_in = "no mode yet" if ledger.mode is None else str(ledger.mode)
        raise StepMismatchError(
            f"{who} contributes in {mode} (switch {epoch}), but model {ledger.model!r} "
            f"steps in {steps_in} (switch {ledger.mode_epoch}); every rank must use the "
            "same mode, and switch (set_sync_mode) at the same step")


def wire_mismatch(ledger, wire: int) -> str:
    """Why a contribution in the header's ``wire`` value does not fit ``ledger`` ("" if it does).

    Raises:
        ProtocolError: an unknown wire format value.
    """
    try:
        fmt = format_from_wire(wire)
    except ProtocolError:
        raise ProtocolError(f"unknown wire format {wire} in a contribution header") from None
    if ledger.numel is None or fmt == ledger.wire:
        return ""
    name = "float32" if fmt is None else fmt.name
    theirs = "float32" if ledger.wire is None else ledger.wire.name
    return (f"sent its gradient in {name}, but model {ledger.model!r} steps in {theirs}; every "
            "rank of a model must use the same wire format")


def hyper_mismatch(ledger, hyper) -> str:
    """Why a contribution's optimizer hyperparameters do not fit ``ledger`` ("" if they do)."""
    if not all(math.isfinite(v) for v in hyper):
        return f"sent optimizer hyperparameters that are not finite: {list(hyper)}"
    if ledger.hyper_len is not None and len(hyper) != ledger.hyper_len:
        return (f"sent {len(hyper)} optimizer hyperparameters, but model {ledger.model!r}'s "
                f"contributions carry {ledger.hyper_len}; every rank must build the same "
                "optimizer (the same parameter groups and options)")
    return ""
