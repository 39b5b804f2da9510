"""all_reduce_coalesced: many arrays reduced as a few flat buckets, for any framework.

The framework-neutral sibling of DDP's gradient buckets: numpy arrays or torch tensors (CPU or
CUDA) of any shapes and (supported) dtypes go in, arrays of the same shapes, types and devices
come out. The arrays are grouped by dtype into :class:`~gradstar.client.buckets.BucketPlan`
buckets of at most ``bucket_cap_mb``, in the order given; each bucket is flattened into one array
and all the buckets' all_reduces run concurrently.

:meth:`AsyncProcessGroup.all_reduce_coalesced` calls :func:`all_reduce_coalesced`, and the
blocking :meth:`ProcessGroup.all_reduce_coalesced` wraps that coroutine like every other
collective.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Protocol

import numpy as np

from gradstar.wire.encoded import carries

from .buckets import BucketPlan, TensorSpec, cap_bytes_of
from .convert import ArrayLike, copies_to_device, to_numpy


class AllReducer(Protocol):
    """What the buckets are reduced with: an ``AsyncProcessGroup`` (named structurally, so this
    module does not import the process group that calls it)."""

    def all_reduce(self, x, op: str = "sum", *, timeout: float | None = None,
                   wire: str | None = None) -> Awaitable[ArrayLike]: ...


def all_reduce_coalesced(group: AllReducer, arrays: Sequence, op: str = "mean",
                         bucket_cap_mb: float = 25, *, timeout: float | None = None,
                         wire: str | None = None) -> Awaitable[list[ArrayLike]]:
    """Reduce every array in ``arrays`` over the ranks; resolves to a list in the same order.

    ``wire``: a compressed wire format (see ``AsyncProcessGroup.all_reduce``) for the float
    buckets; buckets of an integer dtype travel exactly, in their own dtype.

    Every bucket's collective is issued (takes its sequence number) when this is *called*, so
    all ranks must call it with the same shapes, dtypes and ``bucket_cap_mb``, in the same order
    relative to their other collectives. Empty arrays are not sent and come back as empty copies.
    Results of one bucket share one buffer (each is a view of its own slice of it), except CUDA
    tensors, each of which comes back as a new tensor on its own device.

    Raises:
        ConfigurationError: an unsupported op, dtype or object, a bad ``bucket_cap_mb``, or a
            ``wire`` format the op does not take.
        CollectiveError and subclasses (when awaited): as for ``all_reduce``; ``op="mean"`` of
            an integer dtype is an InvalidCollectiveError.
    """
    converted = [to_numpy(x) for x in arrays]
    cap = cap_bytes_of(bucket_cap_mb)
    sent = [i for i, (arr, _) in enumerate(converted) if arr.size]
    plan = BucketPlan([TensorSpec(converted[i][0].size, converted[i][0].itemsize,
                                  converted[i][0].dtype) for i in sent], cap, reverse=False)
    pending = []
    try:
        for bucket in plan:
            flat = np.empty(bucket.numel, dtype=bucket.dtype)
            for member, offset, numel in zip(bucket.members, bucket.offsets, bucket.numels,
                                             strict=True):
                flat[offset:offset + numel] = converted[sent[member]][0].reshape(-1)
            pending.append(group.all_reduce(flat, op, timeout=timeout,
                                            wire=wire if carries(flat.dtype) else None))
    except BaseException:
        for call in pending:  # withdrawn: a started task tells the hub, a coroutine never ran
            call.cancel() if isinstance(call, asyncio.Future) else call.close()
        raise
    return _gather(plan, pending, converted, sent)


async def _gather(plan: BucketPlan, pending: list, converted: list, sent: list[int]) -> list:
    results = await asyncio.gather(*pending, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    if any(copies_to_device(restore) for _, restore in converted):
        # Copies to a GPU block: off the event loop (see convert.delivered).
        return await asyncio.to_thread(_outputs, plan, results, converted, sent)
    return _outputs(plan, results, converted, sent)


def _outputs(plan: BucketPlan, results: list, converted: list, sent: list[int]) -> list:
    out: list = [None if arr.size else restore(arr.copy()) for arr, restore in converted]
    for bucket, flat in zip(plan, results, strict=True):
        for member, offset, numel in zip(bucket.members, bucket.offsets, bucket.numels,
                                         strict=True):
            arr, restore = converted[sent[member]]
            result = restore(flat[offset:offset + numel].reshape(arr.shape))
            # convert's bfloat16 restore goes through np.ascontiguousarray, which makes a 0-d
            # tensor 1-d; put the shape back until convert.py keeps it.
            out[sent[member]] = result if result.shape == arr.shape else result.reshape(arr.shape)
    return out


__all__ = ["AllReducer", "all_reduce_coalesced"]
