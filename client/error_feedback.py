"""Error feedback for gradients sent in a lossy wire format (PowerSGD's and 1-bit SGD's trick).

Sending a gradient ``g`` in a compressed format delivers ``roundtrip(fmt, g)``, not ``g``. With
error feedback a rank remembers what its own contribution lost, the *residual*
``e = v - roundtrip(fmt, v)`` of what it sent, ``v = g + e_prev``, and adds it to the same
bucket's gradient at the next step. Nothing is lost for good: over ``T`` steps the sum of what
the rank sent differs from the sum of its gradients by one residual only (one rounding of one
step), instead of ``T`` independent roundings. The residual of a rank is its own; ranks never
exchange it.

What is compensated: the rounding of each rank's contribution on the way to the hub. The hub
rounds the reduced result once more on the way back (every rank gets the same bytes, so the
replicas stay identical); that rounding is not compensated here, since no rank sees the
float32 result it came from.

The residual is computed by the codec on the rank (:func:`gradstar.wire.formats.roundtrip` of the
whole bucket), which is what the collective will send: a chunk holds whole blocks, so the
chunk-wise encoding of the stream equals the encoding of the whole array. (Over the two-level
all_reduce of several ranks per host the leaders encode the host's float32 partial sum instead;
each rank's residual is then that of its own contribution as if it had sent it alone, an
approximation of the same size.)

Used by :class:`gradstar.DDP` (key: the bucket index; in a sync mode other than Synchronous,
one key for the whole flat gradient, see :mod:`gradstar.client.steps.sync`) and by the torch
communication hook of :mod:`gradstar.client.torch_backend.comm_hooks` (key: torch's bucket
index).

A contribution that never reaches a result (the hub dropped or refused it) must not change the
residual: the sender takes :meth:`ErrorFeedback.save` before :meth:`ErrorFeedback.compensate`
and puts it back with :meth:`ErrorFeedback.restore`, so the dropped gradient does not leak into
the next step and the older residual is not lost.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence

import torch

from gradstar.errors import ConfigurationError
from gradstar.wire.formats import FORMATS, WireFormat, roundtrip, wire_format

logger = logging.getLogger(__name__)


class ErrorFeedback:
    """The residuals of one sender's buckets in the wire format ``fmt``.

    Memory: one float32 buffer per bucket, of the bucket's element count, on the bucket's
    device; created at a bucket's first :meth:`compensate`. A bucket whose size or device changed
    (re-planned) starts again from a zero residual.

    Raises:
        ConfigurationError: ``fmt`` is not a wire format.
    """

    def __init__(self, fmt: str | WireFormat) -> None:
        self.format = wire_format(fmt)
        self._residuals: dict[Hashable, torch.Tensor] = {}

    @property
    def residuals(self) -> dict[Hashable, torch.Tensor]:
        """The residual of each bucket key seen so far (for inspection; do not write)."""
        return dict(self._residuals)

    def reset(self) -> None:
        """Forget every residual (the next step sends its gradients as they are)."""
        self._residuals.clear()

    def save(self, key: Hashable) -> torch.Tensor | None:
        """A copy of ``key``'s residual now (None: it has none yet), for :meth:`restore`."""
        residual = self._residuals.get(key)
        return None if residual is None else residual.clone()

    def restore(self, key: Hashable, saved: torch.Tensor | None) -> None:
        """Put back what :meth:`save` returned (None: ``key`` has no residual again)."""
        if saved is None:
            self._residuals.pop(key, None)
        else:
            self._residuals[key] = saved

    def load(self, residuals: dict[Hashable, torch.Tensor]) -> None:
        """Replace every residual by ``residuals`` (a sender that re-planned its buckets moves
        each residual to its new bucket key and offset; nothing it held is lost)."""
        self._residuals = dict(residuals)

    def compensate(self, key: Hashable, flat: torch.Tensor,
                   keep: Sequence[tuple[int, int]] = ()) -> None:
        """Add ``key``'s residual to ``flat`` in place and remember what sending it will lose.

        ``flat`` is the contiguous float32 bucket about to be sent in this format. ``keep``:
        ``(offset, numel)`` slices that must go out as zeros (a parameter without a gradient on
        this rank); their residual is carried over to the next step instead of being sent.
        An element that is NaN or ±Inf gets a zero residual, so a step skipped for overflow
        (as torch's GradScaler skips them) does not poison the steps after it.

        Raises:
            ConfigurationError: ``flat`` is not a contiguous float32 tensor.
        """
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            raise ConfigurationError(
                f"error feedback works on contiguous float32 buckets, got {flat.dtype}")
        residual = self._residuals.get(key)
        if residual is None or residual.shape != flat.shape or residual.device != flat.device:
            if residual is not None:
                logger.info("bucket %r changed from %s to %s elements: its residual restarts "
                            "from zero", key, residual.numel(), flat.numel())
            residual = self._residuals[key] = torch.zeros_like(flat)
        with torch.no_grad():
            carried = [(offset, numel, residual[offset:offset + numel].clone())
                       for offset, numel in keep]
            flat.add_(residual)
            for offset, numel, _ in carried:
                flat[offset:offset + numel].zero_()
            # The codec runs on numpy: a CPU bucket is viewed, a CUDA one copied to the host.
            sent = torch.from_numpy(roundtrip(self.format, flat.detach().cpu().numpy()))
            torch.sub(flat, sent.to(flat.device), out=residual)
            torch.nan_to_num_(residual, nan=0.0, posinf=0.0, neginf=0.0)
            for offset, numel, old in carried:
                residual[offset:offset + numel] = old


def check_error_feedback(wire: str | None, error_feedback: bool | None) -> ErrorFeedback | None:
    """The residual store that ``wire=`` and ``error_feedback=`` ask for: on by default with any
    format (every format is lossy), None without a format or with ``error_feedback=False``.

    Raises:
        ConfigurationError: an unknown format, or ``error_feedback=True`` without a format.
    """
    if wire is None:
        if error_feedback:
            names = [repr(name) for name in FORMATS]
            raise ConfigurationError(
                f"error_feedback=True needs a lossy wire format (wire={', '.join(names[:-1])} or "
                f"{names[-1]}); without one nothing is rounded and there is nothing to feed back")
        return None
    fmt = wire_format(wire)
    return None if error_feedback is False else ErrorFeedback(fmt)


__all__ = ["ErrorFeedback", "check_error_feedback"]
