"""Tensors on a GPU: staged through host memory on their way to and from the wire.

gradstar's wire, shared-memory segments and hub carry host memory. A CUDA tensor passed to a
collective or a send is copied to host memory **when the call is made**, travels as a CPU tensor
would, and its result is copied back to the tensor's device before the call resolves: the staging
torch's gloo backend does for CUDA tensors.

* **Order.** The copy to the host is queued on the caller's current CUDA stream and waited for,
  in the caller's thread, before the call returns: it sees every kernel queued before the call
  (the tensor's producer), and the caller may overwrite the tensor as soon as the call returned
  (a Work or awaitable in hand), as with torch's backends.
* **Results.** The copy back runs in the thread that completes the call and is waited for before
  the result is handed over, so the result is ready on every stream (no event to wait on, no
  ``record_stream`` needed for the copy itself). A new result tensor is allocated, and the copy
  runs, on the stream that was the caller's current one when the call was made
  (:func:`caller_stream`, :func:`to_device`), whichever thread completes the call: use it on
  another stream as any tensor made on that stream (``Tensor.record_stream`` before freeing it
  there).
* **Host buffers.** Page-locked (pinned) memory copies at the bus's full speed and without a
  bounce through the driver's staging area. torch's caching host allocator reuses pinned blocks
  once their tensors are freed; gradstar bounds how much of it its own staging holds at once
  (:data:`PINNED_LIMIT_ENV`, default :data:`DEFAULT_PINNED_LIMIT`) and stages through ordinary
  (pageable) memory beyond that bound, slower but never refused: pinned memory cannot be
  swapped out, so an unbounded amount would starve the rest of the machine.
* **Other devices.** Tensors on mps, xpu, meta or any other non-CUDA device are refused with a
  :class:`~gradstar.errors.ConfigurationError` naming the device.

Whole-tensor staging is chosen over chunk-by-chunk overlap of the copies with the stream: a host
copy runs at 10-25 GB/s, the wire and the hub at about 1 GB/s per rank, so overlapping would save
a few percent of a collective's time at the cost of CUDA events threaded through the stream's
send and receive paths (see the README's "GPU tensors").

Nothing here runs without a CUDA tensor: the CPU path neither imports CUDA nor pins memory.
"""

from __future__ import annotations

import os
import threading
import weakref

from gradstar.errors import ConfigurationError

#: Environment variable: the most bytes of pinned host memory gradstar's staging holds at once.
PINNED_LIMIT_ENV = "GRADSTAR_PINNED_LIMIT_MB"
#: Default bound on the pinned memory held by staging buffers at once (1 GiB).
DEFAULT_PINNED_LIMIT = 1 << 30
#: Device types whose tensors gradstar stages through host memory.
STAGED_DEVICES = ("cuda",)


def check_device(t, what: str = "this tensor") -> None:
    """Accept a CPU or CUDA tensor.

    Raises:
        ConfigurationError: ``t`` lives on another device (mps, xpu, meta, ...), named.
    """
    if t.is_cpu:  # the common case, without making a torch.device
        return
    if t.device.type not in STAGED_DEVICES:
        raise ConfigurationError(
            f"gradstar moves CPU and CUDA tensors; {what} is on {t.device}: call .cpu() first")


def is_staged(t) -> bool:
    """Whether ``t`` lives on a device gradstar stages through host memory."""
    # t.is_cpu first: a CPU tensor's answer without making a torch.device
    return ("cpu" if t.is_cpu else t.device.type) in STAGED_DEVICES


class PinnedBudget:
    """How many bytes of pinned host memory staging buffers hold right now, bounded.

    :meth:`take` answers whether a new buffer of ``nbytes`` may be pinned and, if so, counts it;
    :meth:`track` returns the bytes when the object holding the buffer is garbage-collected (a
    ``weakref.finalize``), :meth:`give_back` at once. Thread-safe:
    callers' threads stage inputs while the loop and completion threads stage results.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return self._held

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self._held + nbytes > self.limit:
                return False
            self._held += nbytes
            return True

    def track(self, buffer, nbytes: int) -> None:
        """Count ``nbytes`` (already taken) until ``buffer`` is collected."""
        weakref.finalize(buffer, self.give_back, nbytes)

    def give_back(self, nbytes: int) -> None:
        with self._lock:
            self._held -= nbytes


def _limit_from_env() -> int:
    raw = os.environ.get(PINNED_LIMIT_ENV, "").strip()
    if not raw:
        return DEFAULT_PINNED_LIMIT
    try:
        mb = float(raw)
    except ValueError:
        raise ConfigurationError(
            f"{PINNED_LIMIT_ENV} must be a number of MiB, got {raw!r}") from None
    if mb < 0:
        raise ConfigurationError(f"{PINNED_LIMIT_ENV} must be >= 0, got {raw!r}")
    return int(mb * (1 << 20))


_budget: PinnedBudget | None = None
_budget_lock = threading.Lock()


def pinned_budget() -> PinnedBudget:
    """The process's one :class:`PinnedBudget` (read from the environment on first use)."""
    global _budget
    with _budget_lock:
        if _budget is None:
            _budget = PinnedBudget(_limit_from_env())
        return _budget


def to_host_array(t):
    """A host copy of ``t`` (a staged device tensor, any strides) as a C-contiguous numpy
    array, complete when this returns; bfloat16 comes as its int16 bits (numpy has no
    bfloat16: :mod:`gradstar.client.convert` views them as ml_dtypes.bfloat16).

    The copy is queued on the current stream of ``t``'s device and waited for (``copy_`` into
    host memory without ``non_blocking`` synchronizes that stream). The host buffer is pinned
    while the budget allows; its bytes stay counted until the array and every view of it are
    gone.
    """
    import torch

    wire = t.detach().view(torch.int16) if t.dtype == torch.bfloat16 else t.detach()
    nbytes = wire.numel() * wire.element_size()
    # torch's caching host allocator rounds a pinned block up to a power of two: count that.
    held = 1 << max(nbytes - 1, 0).bit_length()
    budget = pinned_budget()
    pinned = _pins(t) and nbytes > 0 and budget.take(held)
    host = None
    if pinned:
        try:
            host = _allocate(wire.shape, wire.dtype, True)
        except RuntimeError:
            # Page-locking failed (ulimit -l, a container's limit): stage through pageable
            # memory instead, slower but never refused.
            budget.give_back(held)
            pinned = False
    try:
        host = _allocate(wire.shape, wire.dtype, False) if host is None else host
        host.copy_(wire)
        arr = host.numpy()
    except BaseException:
        if pinned:
            budget.give_back(held)
        raise
    if pinned:
        # Every numpy view of ``arr`` keeps arr.base (the tensor numpy was handed) alive, not
        # ``host`` itself: count the bytes for as long as that object lives.
        budget.track(arr.base, held)
    return arr


def _pins(t) -> bool:
    return t.device.type == "cuda"


def _allocate(shape, dtype, pinned: bool):
    import torch

    return torch.empty(shape, dtype=dtype, pin_memory=pinned)


def caller_stream(device):
    """The calling thread's current stream of ``device`` (a CUDA device), None for others:
    :func:`to_device` allocates and copies a result on it (see :func:`to_device`)."""
    import torch

    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def to_device(host, device, *, stream=None):
    """``host`` (a CPU tensor) copied to a new tensor on ``device``, complete on every stream
    when this returns.

    ``stream`` (a CUDA stream of ``device``; default: this thread's current one) is where the
    new tensor is allocated and the copy runs. Staged results pass the stream that was current
    when the call was made (:func:`caller_stream`): the caching allocator then files the
    memory under the caller's stream, so it is reused in that stream's order after the caller
    frees it, and the copy cannot overwrite a block the caller's queued kernels still read.
    """
    import torch

    if stream is not None and stream != torch.cuda.current_stream(device):
        with torch.cuda.stream(stream):
            return _copied_to(host, device)
    # Already this thread's current stream (the blocking caller's own thread): no switch, which
    # costs as much as a tiny tensor's copy (docs/performance.md, "Figures behind the code").
    return _copied_to(host, device)


def _copied_to(host, device):
    import torch

    target = torch.empty(host.shape, dtype=host.dtype, device=device)
    # Not non_blocking: a copy between the host and a device is then synchronous with respect
    # to the host (torch waits for the current stream, which ran it after every kernel queued
    # there), so the result is complete for every stream when this returns.
    target.copy_(host)
    return target


def synchronize(device) -> None:
    """Wait for every copy queued on this thread's current stream of ``device`` (a CUDA device;
    a no-op for the CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


__all__ = [
    "DEFAULT_PINNED_LIMIT",
    "PINNED_LIMIT_ENV",
    "STAGED_DEVICES",
    "PinnedBudget",
    "caller_stream",
    "check_device",
    "is_staged",
    "pinned_budget",
    "synchronize",
    "to_device",
    "to_host_array",
]
