"""Moving a forward pass's inputs to the module's device, as torch's DDP does with
``device_ids``: tensors anywhere in nested tuples (named tuples included), lists and dicts."""

from __future__ import annotations

import copy

import torch


def to_device(value, device: torch.device):
    """``value`` with every tensor in it moved to ``device`` (``Tensor.to``: no copy for a tensor
    already there); tuples, named tuples, lists and dicts are rebuilt with the same type, any
    other object is passed as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(to_device(v, device) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):  # a shallow copy keeps the type (OrderedDict, defaultdict...)
        moved = copy.copy(value)
        moved.update((k, to_device(v, device)) for k, v in value.items())
        return moved
    return value


def inputs_to_device(inputs: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, dict]:
    """A forward's positional and keyword inputs moved to ``device`` (:func:`to_device`)."""
    return to_device(inputs, device), to_device(kwargs, device)


__all__ = ["inputs_to_device", "to_device"]
