"""How much a pipeline stage holds for its backward passes (see
:attr:`gradstar.client.pipeline.Pipeline.peak_activation_bytes`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch


class _Saved:
    """A tensor saved for backward, boxed so its release can be observed."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ActivationMeter:
    """Bytes of storage held for backward passes, counted once per storage, and their peak.

    Tensors saved by autograd are counted through ``saved_tensors_hooks`` and released when
    autograd frees them; :meth:`hold` counts a tensor the pipeline keeps itself. Storages of
    ``excluded`` tensors (the parameters) are not activations and are never counted.
    """

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, list[int]] = {}  # storage address -> [count, bytes]
        self._excluded: set[int] = set()

    def exclude(self, tensors) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in tensors}

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def hold(self, tensor: torch.Tensor) -> Callable[[], None]:
        """Count ``tensor``'s storage until the returned function is called."""
        key = self._acquire(tensor)
        return (lambda: self._release(key)) if key is not None else (lambda: None)

    def _acquire(self, tensor: torch.Tensor) -> int | None:
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key in self._excluded or nbytes == 0:
            return None
        ref = self._refs.setdefault(key, [0, nbytes])
        ref[0] += 1
        if ref[0] == 1:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return key

    def _release(self, key: int) -> None:
        ref = self._refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[key]
            self.live_bytes -= ref[1]

    def _pack(self, tensor: torch.Tensor):
        key = self._acquire(tensor)
        if key is None:
            return tensor
        box = _Saved(tensor)
        weakref.finalize(box, self._release, key)
        return box

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed
