"""The optimizer hyperparameters a contribution carries and a step is applied with: a
learning-rate schedule steps per rank iteration, while every rank applies a step at its own
iteration, so each step records its contributions' values and every rank applies it with
those (:class:`~.sync.StepSync`)."""

from __future__ import annotations

import torch

#: The optimizer options a contribution carries (those LR schedulers move), where present.
HYPER_KEYS = ("lr", "momentum", "betas", "weight_decay")


def read_hyper(optimizer: torch.optim.Optimizer) -> list[tuple[int, str, float]]:
    """(group, key, value) of every numeric option in HYPER_KEYS (a tuple's items in turn)."""
    out = []
    for i, group in enumerate(optimizer.param_groups):
        for key in HYPER_KEYS:
            value = group.get(key)
            for v in (value if isinstance(value, tuple | list) else (value,)):
                if isinstance(v, int | float | torch.Tensor) and not isinstance(v, bool):
                    out.append((i, key, float(v)))
    return out


def write_hyper(optimizer: torch.optim.Optimizer, where: list[tuple[int, str, float]],
               values) -> None:
    """Write ``values`` at the places :func:`read_hyper` listed (tensors in place)."""
    items = iter(zip(where, values, strict=True))
    for (i, key, _), v in items:
        group = optimizer.param_groups[i]
        if isinstance(group[key], tuple | list):  # the tuple's items come in order
            rest = [v] + [next(items)[1] for _ in range(len(group[key]) - 1)]
            group[key] = type(group[key])(rest)
        elif isinstance(group[key], torch.Tensor):
            group[key].fill_(v)
        else:
            group[key] = v
