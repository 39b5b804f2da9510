"""How :class:`~gradstar.client.data_parallel.DataParallel` splits a call's arguments over its
replicas and joins their outputs.

Scatter. Every tensor with a batch dimension, wherever it sits in the arguments (tuples, lists,
dicts and namedtuples are walked), is split along dim 0 into as many shards as there are
replicas, or as rows in the smallest such tensor if that is fewer (a batch of 3 rows on 4
devices runs 3 replicas). Shards differ by at most one row, the first ones taking the
remainder (10 rows on 4 replicas: 3, 3, 2, 2). Each shard is copied to its replica's device;
0-d tensors are copied whole to every replica, other values are passed to every replica as
they are. The split and the copies are autograd operations, so a gradient reaches inputs that
require one.

Gather. The replicas' outputs must have one structure: tensors are concatenated along dim 0
on the output device (0-d tensors, such as a loss computed inside the module, are stacked into
one vector with an entry per replica, as torch does); tuples, lists, dicts and namedtuples are
gathered entry by entry into the same type; None stays None; any other value comes back as the
list of every replica's value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from gradstar.errors import ConfigurationError

Shard = tuple[tuple, dict]  # one replica's positional and keyword arguments


def scatter(inputs: tuple, kwargs: dict, devices: Sequence[torch.device]) -> list[Shard]:
    """One (args, kwargs) per replica that runs: ``len(devices)`` of them, or fewer when the
    batch has fewer rows (at least one). See the module docstring for the rules."""
    rows = [t.shape[0] for t in _tensors((inputs, kwargs)) if t.dim() > 0]
    count = max(1, min(len(devices), *rows)) if rows else 1
    return [(_shard(inputs, i, count, devices[i]), _shard(kwargs, i, count, devices[i]))
            for i in range(count)]


def place(inputs: Sequence, kwargs: Sequence[Mapping] | None,
          devices: Sequence[torch.device]) -> list[Shard]:
    """One (args, kwargs) per device from inputs already split by the caller: ``inputs[i]``
    (a tuple or list of positional arguments, or one argument, as torch's ``parallel_apply``
    reads it) and ``kwargs[i]`` go whole to ``devices[i]``, their tensors moved there.

    Raises:
        ConfigurationError: ``inputs`` or ``kwargs`` has not one entry per device.
    """
    kwargs = [{}] * len(inputs) if kwargs is None else list(kwargs)
    for name, given in (("inputs", len(inputs)), ("kwargs", len(kwargs))):
        if given != len(devices):
            raise ConfigurationError(
                f"DataParallel.forward_parallel takes one entry of {name} per device: got "
                f"{given} for {len(devices)} devices ({', '.join(map(str, devices))})")
    return [(_shard(tuple(args) if isinstance(args, tuple | list) else (args,), 0, 1, device),
             _shard(dict(kw), 0, 1, device))
            for args, kw, device in zip(inputs, kwargs, devices, strict=True)]


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from _tensors(value)


def _shard(obj, index: int, count: int, device: torch.device):
    if isinstance(obj, torch.Tensor):
        part = torch.tensor_split(obj, count)[index] if obj.dim() > 0 else obj
        return part.to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        return type(obj)((k, _shard(v, index, count, device)) for k, v in obj.items())
    if _is_namedtuple(obj):
        return type(obj)(*(_shard(v, index, count, device) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_shard(v, index, count, device) for v in obj)
    return obj


def gather(outputs: Sequence, device: torch.device, where: str = "output"):
    """The replicas' ``outputs`` joined on ``device`` (see the module docstring).

    Raises:
        ConfigurationError: the replicas returned differently structured outputs (named by
            where they differ).
    """
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            raise _differs(where, outputs)
        moved = [o.to(device) for o in outputs]
        if len(moved) == 1:
            return moved[0]
        return torch.stack(moved) if first.dim() == 0 else torch.cat(moved)
    if first is None:
        return None
    if isinstance(first, Mapping):
        if not all(isinstance(o, Mapping) and list(o) == list(first) for o in outputs):
            raise _differs(where, outputs)
        return type(first)((k, gather([o[k] for o in outputs], device, f"{where}[{k!r}]"))
                           for k in first)
    if isinstance(first, (tuple, list)):
        if not all(type(o) is type(first) and len(o) == len(first) for o in outputs):
            raise _differs(where, outputs)
        parts = [gather(list(column), device, f"{where}[{i}]")
                 for i, column in enumerate(zip(*outputs, strict=True))]
        return type(first)(*parts) if _is_namedtuple(first) else type(first)(parts)
    return list(outputs)


def _differs(where: str, outputs: Sequence) -> ConfigurationError:
    kinds = ", ".join(_describe(o) for o in outputs)
    return ConfigurationError(
        f"DataParallel cannot gather {where}: the replicas returned differently structured "
        f"values ({kinds}); a module must return the same structure for every shard")


def _describe(value) -> str:
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}"
    if isinstance(value, Mapping):
        return f"{type(value).__name__} with keys {list(value)}"
    return type(value).__name__


def _is_namedtuple(obj) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


__all__ = ["Shard", "gather", "place", "scatter"]
