"""FullyShardedDataParallel: each rank stores 1/world_size of the parameters, gradients and
optimizer state, and holds a unit's full parameters only while that unit computes.

Construction. The module is split into sharding units (:mod:`~gradstar.client.fsdp.plan`).
The ranks check that they derived the same plan (an all_gather of a small fingerprint; a
difference is a :class:`~gradstar.errors.ConfigurationError` naming the rank). Each unit's
parameters are flattened into one padded buffer of which each rank keeps only its contiguous
shard, as an ``nn.Parameter`` in ``flat_shards`` (:mod:`~gradstar.client.fsdp.unit`); with
``sync_module_states`` the shards come from rank 0's buffer, broadcast unit by unit, and the
module buffers from rank 0 too. The original parameters are removed from the modules.
``parameters()`` yields the shards, so an optimizer built on them keeps its state sharded too.

Training. Each unit is all-gathered around its forward and again for its backward, and its
gradient reduce-scattered, as :mod:`~gradstar.client.fsdp.runtime` describes; after
``loss.backward()`` each shard's ``.grad`` holds the mean over ranks of the gradient of that
shard. Checkpoints: :mod:`~gradstar.client.fsdp.state_dict`.

By hand. Inside :meth:`~FullyShardedDataParallel.no_sync` backward passes keep each unit's
whole gradient unreduced; the next synchronising backward reduces it with its own, or
:meth:`~FullyShardedDataParallel.sync_gradients` reduce-scatters it explicitly (a no-op when
nothing is kept, so never a second reduction). :meth:`~FullyShardedDataParallel.into_inner`
gathers the parameters for good and hands the plain module back.

Devices. The module is on the CPU or on one CUDA device; shards, gathered buffers, gradients
and state dicts stay there (:mod:`~gradstar.client.fsdp.runtime` says how the collectives
carry them).

Rules. Every rank must construct FSDP from the same module structure and settings, run the
same forwards and backwards, and reach the same units in each backward (as DDP without
``find_unused_parameters``; with it, the units reached may differ, see
:mod:`~gradstar.client.fsdp.unused`). A parameter inside a unit that takes no part in the loss
gets zeros in the unit's flat gradient, and so the mean of the others' gradients. A unit's
parameters exist only during its module's forward (called as ``module(...)``, which runs
hooks); outside it they are empty placeholders (size 0), as with torch's FSDP. Differences
between ranks end in a CollectiveMismatchError or CollectiveTimeoutError, a lost rank in
RankLostError, raised from forward or backward; after one, the process group should be
considered broken, as in torch.distributed. Double backward through the parameters
(``create_graph=True``) is not supported.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Mapping

import torch
from torch import nn

from gradstar.client.process_group.protocol import CollectiveGroup
from gradstar.client.torch_common import (
    GRAD_DTYPES,
    broadcast_from_rank0,
    check_wrapper_arguments,
    wire_dtype_of,
)
from gradstar.errors import ConfigurationError
from gradstar.wire.formats import wire_format

from . import state_dict as checkpoint
from .plan import AutoWrapPolicy, UnitPlan, plan_units
from .records import UnitCollective
from .runtime import UnitRuntime
from .unit import ShardingUnit


class FullyShardedDataParallel(nn.Module):
    """Shards ``module``'s parameters, gradients and optimizer state over the ranks of ``pg``.

    Build the optimizer on ``fsdp.parameters()`` (the flat shards) after wrapping. ``forward``
    runs the wrapped module; after ``loss.backward()`` each shard's ``.grad`` holds the mean
    gradient over ranks of that shard. Save with :meth:`full_state_dict` (an ordinary
    ``state_dict`` a plain model loads) or :meth:`sharded_state_dict` (per rank); ``state_dict()``
    itself is nn.Module's: this rank's flat shards and the buffers. See the module docstring for
    the protocol and its rules.

    For inspection and tests: ``units`` (the :class:`ShardingUnit` list, root first),
    ``last_collectives`` and ``peak_gathered_numel``.

    Args:
        module: the model, all on the CPU or all on one CUDA device (``device`` is that
            device); its parameters are moved into the shards, which stay on that device.
        pg: the blocking :class:`gradstar.ProcessGroup` (hooks run inside autograd).
        auto_wrap_policy: which submodules are sharding units: None (each direct child holding
            parameters), a list of module classes, or a callable ``policy(module) -> bool``;
            the root is a unit for the rest (see :mod:`gradstar.client.fsdp.plan`).
        mixed_precision: "bf16" or "fp16" gathers parameters and reduces gradients in that
            dtype; shards, optimizer and compute stay in the parameters' dtype (the gathered
            values are widened back: CPU matmuls in bf16 are slow and would need the inputs
            cast). None communicates in the parameters' dtype.
        wire: a compressed wire format ("bf16", "fp16", "int8", "int4") for the gradients'
            reduce-scatter (the hub or shard decodes and averages in float32 and encodes each
            rank's mean shard once); gathers are unchanged. No error feedback: its residual
            would be an unsharded gradient per unit, the memory FSDP exists to save.
        prefetch: gather the next unit while the current one computes, in forward and backward.
        sync_module_states: start every rank from rank 0's parameters (broadcast unit by
            unit) and buffers.
        find_unused_parameters: allow backward passes that reach different units on different
            ranks (branches, conditional heads, experts): units stay gathered from forward to
            backward and are reduced when backward ends, those some rank reached, in unit
            order, with zeros from the ranks that did not; a unit no rank reached keeps its
            ``shard.grad`` (:mod:`~gradstar.client.fsdp.unused`). Costs one small all_reduce
            per backward, the memory of every unit gathered at once, and the overlap.

    Raises:
        ConfigurationError: ``pg`` is not a blocking process group, an argument is invalid, the
            module has no parameter, a parameter is not floating point, the module is not on
            the CPU or one CUDA device (named), a unit mixes
            dtypes or frozen and trainable parameters, or the ranks' sharding plans differ.
        CollectiveError and subclasses: a construction collective failed.
    """

    def __init__(self, module: nn.Module, pg: CollectiveGroup, *,
                 auto_wrap_policy: AutoWrapPolicy = None, mixed_precision: str | None = None,
                 prefetch: bool = True, sync_module_states: bool = True,
                 wire: str | None = None, find_unused_parameters: bool = False) -> None:
        super().__init__()
        self.device = check_wrapper_arguments("FullyShardedDataParallel", module, pg)
        wire_dtype = wire_dtype_of("mixed_precision", mixed_precision)
        self.wire = None if wire is None else wire_format(wire).name
        for name, p in module.named_parameters():
            if p.dtype not in GRAD_DTYPES:
                raise ConfigurationError(
                    f"parameter {name} has dtype {p.dtype}; FSDP shards float32, float64, "
                    "float16 or bfloat16 parameters"
                )
        plans = plan_units(module, auto_wrap_policy)
        if not plans:
            raise ConfigurationError(
                "FullyShardedDataParallel needs a module with at least one parameter; there "
                "is nothing to shard"
            )
        self.module = module
        self.process_group = pg
        self.mixed_precision = mixed_precision
        _check_plans_agree(pg, plans, wire_dtype, self.wire)

        # What module.state_dict() held, in its order, and which entries are parameters.
        self.state_dict_keys: list[str] = list(module.state_dict(keep_vars=True))
        # Each module's parameter names in registration order, for into_inner() to restore.
        self._parameter_order = [(m, list(m._parameters)) for m in module.modules()]
        self.param_keys: dict[str, tuple[int, int]] = {
            name: (u, i) for u, plan in enumerate(plans)
            for i, param in enumerate(plan.params) for name in param.names}
        self.units = [ShardingUnit(i, plan, pg.world_size, pg.rank, wire_dtype)
                      for i, plan in enumerate(plans)]
        if sync_module_states:
            checkpoint.scatter_from_rank0(
                pg, self.units, lambda unit: [p.param for p in plans[unit.index].params])
            broadcast_from_rank0(pg, list(module.buffers()), checkpoint.BROADCAST_CAP)
        for unit in self.units:
            unit.detach_parameters()
        self.flat_shards = nn.ParameterList([unit.shard for unit in self.units])
        self.find_unused_parameters = bool(find_unused_parameters)
        self.runtime = UnitRuntime(self.units, pg, prefetch=bool(prefetch), wire=self.wire,
                                   find_unused=self.find_unused_parameters)
        self._unwrapped = False

    # -- the nn.Module surface -----------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        """Run the wrapped module, gathering each unit around its forward.

        Raises:
            ConfigurationError: :meth:`into_inner` has taken the module back.
            CollectiveError and subclasses: a gather failed (every unit is sharded again).
        """
        self._check_wrapped("forward")
        return self.runtime.run(self.module, *inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without reducing them: the backward of a forward run inside
        keeps each unit's whole gradient on this rank (one unsharded gradient per unit, the
        memory torch's FSDP ``no_sync`` costs too) instead of reduce-scattering it. The next
        backward outside reduces what was kept with its own gradients, or
        :meth:`sync_gradients` reduces it explicitly. Every rank must do the same."""
        previous = self.runtime.require_sync
        self.runtime.require_sync = False
        try:
            yield
        finally:
            self.runtime.require_sync = previous

    def sync_gradients(self) -> None:
        """Reduce-scatter what :meth:`no_sync` backward passes kept, now: each shard's ``.grad``
        gets the mean over ranks of the kept gradient of that shard added. For loops that
        drive FSDP by hand (accumulate without sync, then reduce before ``optimizer.step()``).

        A no-op where a backward already reduced everything (nothing is kept after a
        synchronising backward), so calling it after a normal backward never reduces a
        gradient twice. Every rank must call it, having run the same backward passes.

        Raises:
            ConfigurationError: called after :meth:`into_inner`.
            CollectiveError and subclasses: a reduce-scatter failed.
        """
        self._check_wrapped("sync_gradients")
        self.runtime.sync_kept_gradients()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """nn.Module's ``zero_grad`` (the shards' ``.grad``), and drop what :meth:`no_sync`
        backward passes kept, as torch's FSDP does (``optimizer.zero_grad()`` clears only the
        shards' ``.grad``)."""
        super().zero_grad(set_to_none)
        self.runtime.drop_kept_gradients()

    def into_inner(self) -> nn.Module:
        """Take the wrapped module back, with its full parameters: every unit is all-gathered
        (one ahead, exact in the parameters' dtype) and each parameter becomes an ordinary
        ``nn.Parameter`` of its module again, in its original place and registration order
        (tied parameters tied again), trainable as before. The hooks are removed, so the
        module runs as a plain ``nn.Module``; gradients are not carried over (``.grad`` is
        None) and an optimizer built on the shards no longer applies. Every rank must call it
        and gets its own full copy. This wrapper is unusable afterwards.

        Raises:
            ConfigurationError: called twice, or while a backward pass through the units
                is running.
            CollectiveError and subclasses: a gather failed (the wrapper is then unchanged).
        """
        self._check_wrapped("into_inner")
        if self.runtime.in_backward:
            raise ConfigurationError(
                "FSDP.into_inner() was called during a backward pass; call it between steps")
        gathered = list(checkpoint.gathered_units(self.process_group, self.units))
        self.runtime.close()
        for unit, flat in gathered:
            unit.restore_parameters(flat)
            unit.kept_grad = None
        for module, names in self._parameter_order:
            params = module._parameters
            module._parameters = {name: params[name] for name in names if name in params}
        self._unwrapped = True
        return self.module

    def update_shards(self, flat: torch.Tensor) -> None:
        """Set this rank's shards from one flat buffer: the units' shards end to end, in
        ``units`` order, the layout of ``torch.nn.utils.parameters_to_vector(
        fsdp.parameters())`` (padding included), so the two round-trip. Each piece is copied,
        cast to its shard's dtype and moved to its device; the optimizer keeps its state (the
        shards are the same Parameters). No communication: each rank sets its own, and what
        the ranks set together is the model (after the same update on every rank, the
        replicas agree). Between steps only.

        Raises:
            ConfigurationError: ``flat`` is not a 1-D floating-point torch tensor of this
                rank's shard size (named, with the size it has); called during a forward or
                backward pass, or after :meth:`into_inner`.
        """
        self._check_wrapped("update_shards")
        sizes = [unit.layout.shard_numel for unit in self.units]
        if not (isinstance(flat, torch.Tensor) and flat.dim() == 1 and flat.is_floating_point()
                and flat.numel() == sum(sizes)):
            got = (f"a {flat.dim()}-D {flat.dtype} tensor of {flat.numel()} elements"
                   if isinstance(flat, torch.Tensor) else type(flat).__name__)
            raise ConfigurationError(
                f"FSDP.update_shards(flat) takes a 1-D floating-point tensor of rank "
                f"{self.process_group.rank}'s {sum(sizes)} shard elements ({len(sizes)} units: "
                f"{', '.join(map(str, sizes))}), as parameters_to_vector(fsdp.parameters()) "
                f"gives; got {got}")
        if self.runtime.in_backward or any(unit.holding for unit in self.units):
            raise ConfigurationError(
                "FSDP.update_shards() was called during a forward or backward pass; call it "
                "between steps")
        with torch.no_grad():
            for unit, piece in zip(self.units, torch.split(flat, sizes), strict=True):
                unit.shard.copy_(piece)

    def _check_wrapped(self, call: str) -> None:
        if self._unwrapped:
            raise ConfigurationError(
                f"FSDP.{call}() after into_inner(): the module was taken back; use the module "
                "into_inner() returned")

    @property
    def prefetch(self) -> bool:
        """Whether the next unit is gathered while the current one computes (settable)."""
        return self.runtime.prefetch

    @prefetch.setter
    def prefetch(self, value: bool) -> None:
        self.runtime.prefetch = bool(value)

    @property
    def last_collectives(self) -> list[UnitCollective]:
        """Every collective issued for a unit since the last forward began, in order."""
        return self.runtime.last_collectives

    @property
    def peak_gathered_numel(self) -> int:
        """The most flat-buffer elements gathered, or being gathered, at once since the last
        forward began."""
        return self.runtime.peak_gathered_numel

    def extra_repr(self) -> str:
        sizes = ", ".join(f"{u.label}:{u.layout.numel}" for u in self.units)
        return (f"world_size={self.process_group.world_size}, units=[{sizes}], "
                f"mixed_precision={self.mixed_precision!r}, wire={self.wire!r}, "
                f"prefetch={self.prefetch}, "
                f"find_unused_parameters={self.find_unused_parameters}")

    # -- state dicts (see gradstar.client.fsdp.state_dict) -------------------------------------

    def full_state_dict(self, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The wrapped module's ordinary ``state_dict()``: keys without a prefix, parameters in
        their shapes, loadable into the plain module. Every rank must call it; with
        ``rank0_only`` only rank 0 gets it (the others get ``{}`` and hold at most two units'
        parameters at a time).

        Raises:
            CollectiveError and subclasses: a gather failed.
        """
        return checkpoint.full_state_dict(self, rank0_only=rank0_only)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor] | None) -> None:
        """Load a full ``state_dict`` given on rank 0 (the other ranks' argument is ignored;
        pass None): parameters are broadcast unit by unit and each rank keeps its shard,
        buffers are broadcast. Every rank must call it. Strict, as ``load_state_dict``.

        Raises:
            ConfigurationError: on every rank, if rank 0's dict has missing or unexpected keys
                or a wrong shape (rank 0's message lists them).
            CollectiveError and subclasses: a broadcast failed.
        """
        checkpoint.load_full_state_dict(self, state_dict)

    def sharded_state_dict(self) -> dict:
        """This rank's part of the model, for per-rank checkpoints; no communication.

        ``{"rank", "world_size", "keys": state_dict order, "tied": {alias: name},
        "params": {name: {"shape", "start", "values"}}, "buffers": {name: tensor}}`` where
        ``values`` are the elements ``start : start + len(values)`` of the flattened parameter
        that this rank's shard holds (possibly none). Plain dicts, lists, ints and tensors, so
        ``torch.load(..., weights_only=True)`` reads it.
        :func:`~gradstar.client.fsdp.state_dict.full_state_dict_from_shards` merges every
        rank's into a full state dict offline.
        """
        return checkpoint.sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dict: Mapping) -> None:
        """Load this rank's :meth:`sharded_state_dict` (same world size and plan); no
        communication.

        Raises:
            ConfigurationError: it belongs to another rank or world size, or does not match
                this rank's shards.
        """
        checkpoint.load_sharded_state_dict(self, state_dict)


def _check_plans_agree(pg, plans: list[UnitPlan], wire_dtype: torch.dtype | None,
                       wire: str | None) -> None:
    """All-gather a fingerprint of the plan; raise the same error on every rank if any differs.

    Raises:
        ConfigurationError: some rank's plan (units, parameter names, shapes, dtypes,
            requires_grad, mixed precision, wire format) differs from rank 0's.
    """
    text = "|".join(
        f"{plan.name}:" + ",".join(f"{p.name}{tuple(p.param.shape)}{p.param.dtype}"
                                   f"{int(p.param.requires_grad)}" for p in plan.params)
        for plan in plans) + f"|{wire_dtype}|{wire}"
    mine = torch.tensor([len(plans), sum(plan.numel for plan in plans),
                         zlib.crc32(text.encode())], dtype=torch.int64)
    everyone = pg.all_gather(mine)
    for rank, theirs in enumerate(everyone):
        if not torch.equal(theirs, everyone[0]):
            units, numel = (int(v) for v in everyone[0][:2])
            their_units, their_numel = (int(v) for v in theirs[:2])
            if (units, numel) != (their_units, their_numel):
                how = (f"{their_units} units of {their_numel} parameter elements against "
                       f"{units} units of {numel}")
            else:
                how = ("as many units and elements, but other parameter names, shapes, dtypes, "
                       "requires_grad, mixed_precision or wire")
            raise ConfigurationError(
                f"rank {rank}'s FSDP sharding plan differs from rank 0's ({how}): every rank "
                "must wrap the same module structure with the same auto_wrap_policy and "
                "mixed_precision, and the same wire"
            )


FSDP = FullyShardedDataParallel

__all__ = ["FSDP", "FullyShardedDataParallel", "UnitCollective"]
