"""A communication hook for torch's DistributedDataParallel over the gradstar backend: every
gradient bucket travels in a compressed wire format, with error feedback.

Registered the way torch's own ``bf16_compress_hook`` is::

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from gradstar.client.torch_backend import WireHookState, wire_compress_hook

    dist.init_process_group(backend="gradstar", init_method="gradstar://HOST:PORT?job=j", ...)
    model = DistributedDataParallel(net)
    model.register_comm_hook(WireHookState("int8"), wire_compress_hook)

What differs from torch's hooks: ``bf16_compress_hook`` casts the bucket and all_reduces it in
bfloat16, so over gloo's ring every hop adds in bfloat16 and the rounding compounds over
``n - 1`` hops; here each rank's bucket is encoded once, the hub decodes every contribution
and adds in float32, and the mean is encoded once for the way back (``pg.all_reduce(x,
op="mean", wire=...)``, see :mod:`gradstar.wire.formats`). And with error feedback (on by
default) each rank adds to every bucket what encoding lost of that bucket at the previous step
(:class:`~gradstar.client.error_feedback.ErrorFeedback`; one float32 buffer per bucket).

Buckets are known by torch's bucket index. torch rebuilds its buckets after the first
iteration (in the order gradients arrived); a bucket whose size changed then starts again
from a zero residual, so the residuals settle from the second step on. The state is the
rank's own, in memory only: a restarted rank starts from zero residuals, as does
:meth:`WireHookState.reset`.
"""

# No ``from __future__ import annotations``: torch's register_comm_hook compares the hook's
# annotations with dist.GradBucket and Future[Tensor] as objects, and refuses strings.
import torch
import torch.distributed as dist

from gradstar.client.error_feedback import ErrorFeedback, check_error_feedback
from gradstar.errors import ConfigurationError
from gradstar.wire.formats import wire_format

from .group import ProcessGroupGradstar


class WireHookState:
    """The state of :func:`wire_compress_hook`: the format, the residuals, the group.

    Args:
        wire: the wire format of every bucket ("bf16", "fp16", "int8", "int4").
        error_feedback: keep each bucket's residual and add it to the next step.
        process_group: the gradstar torch group the buckets are reduced over; None: the group
            torch's DDP passes to the hook's first call is not known to the hook, so the
            default group (the one DDP uses unless told otherwise).

    Raises:
        ConfigurationError: an unknown format.
    """

    def __init__(self, wire: str, error_feedback: bool = True,
                 process_group: ProcessGroupGradstar | None = None) -> None:
        self.wire = wire_format(wire).name
        self.process_group = process_group
        self.feedback: ErrorFeedback | None = check_error_feedback(wire, error_feedback)

    @property
    def error_feedback(self) -> bool:
        """Whether residuals are kept."""
        return self.feedback is not None

    def reset(self) -> None:
        """Forget every residual (e.g. after loading a checkpoint)."""
        if self.feedback is not None:
            self.feedback.reset()

    def group(self) -> ProcessGroupGradstar:
        """The gradstar torch group to reduce over.

        Raises:
            ConfigurationError: it is not gradstar's (another backend cannot decode a format).
        """
        group = self.process_group
        if group is None:
            group = dist.distributed_c10d._get_default_group()
        if not isinstance(group, ProcessGroupGradstar):
            raise ConfigurationError(
                "wire_compress_hook needs a process group of the gradstar backend "
                f"(dist.init_process_group(backend='gradstar')), got {type(group).__name__}: "
                "only gradstar's hub decodes the wire formats")
        return group


def wire_compress_hook(state: WireHookState,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce ``bucket`` to the mean over ranks in ``state.wire`` (with error feedback if
    ``state`` keeps residuals); returns the future torch's DDP waits for, whose value is the
    mean in the bucket's dtype.

    Raises:
        ConfigurationError: not a gradstar group, or a bucket the format cannot carry.
    """
    group = state.group()
    buffer = bucket.buffer()
    # The codec encodes float32, and residuals are float32: other dtypes go through a copy.
    flat = buffer if buffer.dtype == torch.float32 and buffer.is_contiguous() else (
        buffer.detach().to(torch.float32).contiguous())
    if state.feedback is not None:
        state.feedback.compensate(bucket.index(), flat)
    work = group.allreduce_wire(flat, "mean", wire=state.wire)

    def mean(fut: torch.futures.Future) -> torch.Tensor:
        result = fut.value()[0]
        return result if result.dtype == buffer.dtype else result.to(buffer.dtype)

    return work.get_future().then(mean)


__all__ = ["WireHookState", "wire_compress_hook"]
