"""Checkpoints of :class:`~gradstar.client.fsdp.wrapper.FullyShardedDataParallel`.

* **Full**: :func:`full_state_dict` gathers unit after unit (one gather ahead, so a rank never
  holds more than two units' full parameters besides what it keeps) into the wrapped module's
  ordinary ``state_dict()``, on rank 0 only by default; :func:`load_full_state_dict` takes one
  on rank 0, checks it there, tells every rank the verdict, then broadcasts unit after unit and
  each rank keeps its shard. A checkpoint saved from FSDP loads into the plain model and back.
* **Sharded**: :func:`sharded_state_dict` is each rank's own part, without communication;
  :func:`load_sharded_state_dict` loads it back into the same world size and plan, and
  :func:`full_state_dict_from_shards` merges every rank's into a full state dict offline.

Devices: the state dicts FSDP returns hold tensors on the module's device (the CPU or a CUDA
device), as its parameters and buffers are; the loads accept tensors on any device and copy
them to the module's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from gradstar.client.buckets import cap_bytes_of
from gradstar.client.torch_common import broadcast_from_rank0
from gradstar.errors import ConfigurationError

from .unit import ShardingUnit, joined_rows


class FullyShardedDataParallel(Protocol):
    """What a checkpoint reads of the wrapper (:class:`.wrapper.FullyShardedDataParallel`)."""

    module: torch.nn.Module
    process_group: object
    units: list[ShardingUnit]
    state_dict_keys: list[str]
    param_keys: dict[str, tuple[int, int]]

# Buffers are broadcast in flat buckets of at most this many bytes (DDP's default bucket size).
BROADCAST_CAP = cap_bytes_of(25)


def full_state_dict(fsdp: FullyShardedDataParallel, *,
                    rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """See :meth:`FullyShardedDataParallel.full_state_dict`."""
    pg = fsdp.process_group
    keep = not rank0_only or pg.rank == 0
    values: dict[tuple[int, int], torch.Tensor] = {}
    for unit, flat in gathered_units(pg, fsdp.units):
        if keep:
            for i, view in enumerate(unit.unflatten(flat)):
                values[unit.index, i] = view.clone()
    if not keep:
        return {}
    others = fsdp.module.state_dict()  # the buffers (and any extra state) as they are now
    out: dict[str, torch.Tensor] = {}
    for key in fsdp.state_dict_keys:
        if key in fsdp.param_keys:
            out[key] = values[fsdp.param_keys[key]]
        elif key in others:
            out[key] = others[key]
    return out


def gathered_units(pg, units: Sequence[ShardingUnit]):
    """Yield (unit, its whole flat buffer) for each of ``units`` in order, exact (the shards'
    own dtype, never mixed precision's), one gather ahead: a rank holds at most two units'
    buffers at a time beside what the caller keeps.

    Raises:
        CollectiveError and subclasses: a gather failed.
    """
    ahead = pg.all_gather(units[0].shard.detach(), async_op=True)
    for position, unit in enumerate(units):
        work = ahead
        if position + 1 < len(units):
            ahead = pg.all_gather(units[position + 1].shard.detach(), async_op=True)
        yield unit, joined_rows(work.wait())


def load_full_state_dict(fsdp: FullyShardedDataParallel,
                         state_dict: Mapping[str, torch.Tensor] | None) -> None:
    """See :meth:`FullyShardedDataParallel.load_full_state_dict`."""
    pg = fsdp.process_group
    problems = _problems(fsdp, state_dict) if pg.rank == 0 else []
    # Rank 0 alone can judge the dict: every rank learns its verdict before any parameter
    # moves, so a bad checkpoint fails everywhere at once instead of leaving ranks waiting.
    verdict = pg.broadcast(torch.tensor([len(problems)], dtype=torch.int64), src=0)
    if int(verdict[0]):
        if pg.rank == 0:
            raise ConfigurationError(
                "load_full_state_dict: the state dict does not fit the wrapped module: "
                + "; ".join(problems) + ". Nothing was loaded"
            )
        raise ConfigurationError(
            f"load_full_state_dict: rank 0 found {int(verdict[0])} problem(s) in the state "
            "dict it was given (its error lists them). Nothing was loaded"
        )

    scatter_from_rank0(pg, fsdp.units,
                       lambda unit: [state_dict[name] for name in unit.param_names])
    rest = [k for k in fsdp.state_dict_keys if k not in fsdp.param_keys]
    if pg.rank == 0:
        fsdp.module.load_state_dict({k: state_dict[k] for k in rest}, strict=False)
    buffers = dict(fsdp.module.named_buffers(remove_duplicate=False))
    broadcast_from_rank0(pg, [buffers[k] for k in rest if k in buffers], BROADCAST_CAP)


def scatter_from_rank0(pg, units: Sequence[ShardingUnit],
                       tensors_of: Callable[[ShardingUnit], list[torch.Tensor]]) -> None:
    """Overwrite every rank's shards with rank 0's parameter values ``tensors_of(unit)`` (called
    on rank 0 only): each unit's flat buffer is broadcast, one unit ahead, so a rank holds at
    most two units' buffers at a time.

    Raises:
        CollectiveError and subclasses: a broadcast failed.
    """

    def start(unit: ShardingUnit):
        if pg.rank == 0:
            flat = unit.flatten(tensors_of(unit))
        else:
            # Only received into: in host memory even for a CUDA unit, so that nothing is
            # copied off the device for it and only this rank's shard is copied onto it.
            flat = torch.empty(unit.layout.padded_numel, dtype=unit.dtype)
        return pg.broadcast(flat, src=0, async_op=True)

    ahead = start(units[0])
    for position, unit in enumerate(units):
        work = ahead
        if position + 1 < len(units):
            ahead = start(units[position + 1])
        unit.load_flat(work.wait())


def _problems(fsdp: FullyShardedDataParallel, state_dict) -> list[str]:
    if not isinstance(state_dict, Mapping):
        return [f"rank 0 passed {type(state_dict).__name__}, not a mapping of names to tensors"]
    expected = set(fsdp.state_dict_keys)
    problems = []
    missing = [k for k in fsdp.state_dict_keys if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    buffers = dict(fsdp.module.named_buffers(remove_duplicate=False))
    for key in fsdp.state_dict_keys:
        if key not in state_dict:
            continue
        if key in fsdp.param_keys:
            u, i = fsdp.param_keys[key]
            want = fsdp.units[u].shapes[i]
        elif key in buffers:
            want = buffers[key].shape
        else:
            continue  # extra state: the module's own load_state_dict judges it
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key} is a {type(value).__name__}, not a tensor")
        elif value.shape != want:
            problems.append(f"{key} has shape {tuple(value.shape)}, the module's is "
                            f"{tuple(want)}")
    return problems


def sharded_state_dict(fsdp: FullyShardedDataParallel) -> dict:
    """See :meth:`FullyShardedDataParallel.sharded_state_dict`."""
    pg = fsdp.process_group
    params = {}
    for unit in fsdp.units:
        shard = unit.shard.detach()
        held = {s.param: s for s in unit.slices()}
        for i, name in enumerate(unit.param_names):
            piece = held.get(i)
            if piece is None:
                start, values = 0, shard[:0].clone()
            else:
                start = piece.param_start
                values = shard[piece.shard_start:piece.shard_start + piece.numel].clone()
            params[name] = {"shape": list(unit.shapes[i]), "start": start, "values": values}
    tied = {}
    for key, (u, i) in fsdp.param_keys.items():
        if key != fsdp.units[u].param_names[i]:
            tied[key] = fsdp.units[u].param_names[i]
    return {"rank": pg.rank, "world_size": pg.world_size, "keys": list(fsdp.state_dict_keys),
            "tied": tied, "params": params, "buffers": dict(fsdp.module.state_dict())}


def load_sharded_state_dict(fsdp: FullyShardedDataParallel, state_dict: Mapping) -> None:
    """See :meth:`FullyShardedDataParallel.load_sharded_state_dict`."""
    pg = fsdp.process_group
    where = f"rank {pg.rank} of {pg.world_size}"
    try:
        rank, world, params, buffers = (state_dict[k] for k in
                                        ("rank", "world_size", "params", "buffers"))
    except (KeyError, TypeError):
        raise ConfigurationError(
            "load_sharded_state_dict takes what sharded_state_dict() returned: a mapping with "
            "rank, world_size, params and buffers"
        ) from None
    if (rank, world) != (pg.rank, pg.world_size):
        raise ConfigurationError(
            f"this sharded state dict was saved by rank {rank} of {world}; {where} needs its "
            "own (sharded state dicts do not reshard: load a full state dict instead)"
        )
    copies = []
    for unit in fsdp.units:
        held = {s.param: s for s in unit.slices()}
        for i, name in enumerate(unit.param_names):
            entry = params.get(name)
            piece = held.get(i)
            numel = 0 if piece is None else piece.numel
            start = 0 if piece is None else piece.param_start
            if entry is None:
                raise ConfigurationError(f"the sharded state dict for {where} lacks {name}")
            if (list(entry["shape"]) != list(unit.shapes[i]) or entry["values"].numel() != numel
                    or (numel and entry["start"] != start)):
                raise ConfigurationError(
                    f"{name} in the sharded state dict (shape {list(entry['shape'])}, elements "
                    f"{entry['start']}+{entry['values'].numel()}) does not match {where}'s shard "
                    f"(shape {list(unit.shapes[i])}, elements {start}+{numel})"
                )
            if piece is not None:
                copies.append((unit, piece.shard_start, entry["values"]))
    buffer_keys = {k for k in fsdp.state_dict_keys if k not in fsdp.param_keys}
    if set(buffers) != buffer_keys:
        raise ConfigurationError(
            f"the sharded state dict's buffers {sorted(buffers)} are not the module's "
            f"{sorted(buffer_keys)}"
        )
    with torch.no_grad():
        for unit, offset, values in copies:
            unit.shard[offset:offset + values.numel()].copy_(values.reshape(-1))
    fsdp.module.load_state_dict(dict(buffers), strict=False)


def full_state_dict_from_shards(shards: Sequence[Mapping]) -> dict[str, torch.Tensor]:
    """Merge every rank's :meth:`~FullyShardedDataParallel.sharded_state_dict` (any order) into
    the full ``state_dict`` that :meth:`~FullyShardedDataParallel.full_state_dict` would give;
    buffers are rank 0's. No process group needed.

    Raises:
        ConfigurationError: the dicts are not exactly one per rank of one world, or their
            pieces do not cover every parameter exactly.
    """
    if not shards:
        raise ConfigurationError("full_state_dict_from_shards needs every rank's sharded dict")
    world = shards[0]["world_size"]
    by_rank = {sd["rank"]: sd for sd in shards}
    if any(sd["world_size"] != world for sd in shards) or sorted(by_rank) != list(
            range(world)) or len(shards) != world:
        raise ConfigurationError(
            f"need one sharded state dict per rank of one world; got ranks "
            f"{sorted(sd['rank'] for sd in shards)} of world sizes "
            f"{sorted({sd['world_size'] for sd in shards})}"
        )
    first = by_rank[0]
    params = {}
    for name, entry in first["params"].items():
        shape = entry["shape"]
        # On rank 0's device, like the buffers (the dicts may have been loaded onto others).
        flat = torch.empty(math.prod(shape), dtype=entry["values"].dtype,
                           device=entry["values"].device)
        covered = torch.zeros(flat.numel(), dtype=torch.int32)
        for rank in range(world):
            piece = by_rank[rank]["params"][name]
            n = piece["values"].numel()
            flat[piece["start"]:piece["start"] + n].copy_(piece["values"].reshape(-1))
            covered[piece["start"]:piece["start"] + n] += 1
        if not bool((covered == 1).all()):
            raise ConfigurationError(f"the ranks' pieces of {name} do not cover it exactly once")
        params[name] = flat.view(shape)
    out = {}
    for key in first["keys"]:
        name = first["tied"].get(key, key)
        out[key] = params[name] if name in params else first["buffers"][key]
    return out


__all__ = [
    "full_state_dict",
    "full_state_dict_from_shards",
    "load_full_state_dict",
    "load_sharded_state_dict",
    "sharded_state_dict",
]
