"""ShardingPlan: which modules are FSDP's sharding units, and which parameters each one owns.

No sockets and no process group: :class:`~gradstar.client.fsdp.FullyShardedDataParallel`
builds its units from a plan, and ``tests/unit/test_sharding_plan.py``
checks the rules on small modules.

The rules:

* The wrapped (root) module is always a unit, for the parameters no other unit owns. The
  ``auto_wrap_policy`` picks the other units among its submodules:

  - ``None`` (the default): every direct child that holds at least one parameter;
  - a list or tuple of module classes: every submodule (at any depth) that is an instance;
  - a callable ``policy(module) -> bool``: every submodule it returns True for.

* Units may nest. A unit owns the parameters of the modules below it that are not below a
  nested unit, because its forward brackets theirs: its parameters are gathered around its whole
  forward, a nested unit's only around the nested forward.
* A parameter bound to modules in different units (tied weights) belongs to the innermost unit
  that encloses all of them, so it is gathered whenever any of them runs.
* A unit that owns no parameter is dropped: it has nothing to gather.
* A unit's parameters share one flat buffer, so they must share a dtype, and one gradient, so
  they must all be trainable or all frozen.

Units are listed root first, then in module registration order (``named_modules()``), and each
unit's parameters in registration order (``named_parameters()``): every rank derives the same
plan from the same module structure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from gradstar.errors import ConfigurationError

Slot = tuple[nn.Module, str]  # a module and the attribute name a parameter is bound to there
AutoWrapPolicy = Callable[[nn.Module], bool] | Sequence[type[nn.Module]] | None


@dataclass(frozen=True)
class PlannedParam:
    """One parameter of a unit: its first ``named_parameters()`` name, every state_dict name it
    has (several when tied or when its module is shared), and every slot it is bound to."""

    name: str
    param: nn.Parameter
    names: tuple[str, ...]
    slots: tuple[Slot, ...]


@dataclass(frozen=True)
class UnitPlan:
    """A sharding unit: ``module``'s forward brackets the gathering of ``params``."""

    name: str  # the module's path in the root ("" for the root itself)
    module: nn.Module
    params: tuple[PlannedParam, ...]

    @property
    def numel(self) -> int:
        return sum(p.param.numel() for p in self.params)

    @property
    def label(self) -> str:
        return self.name or "<root>"


def wrap_predicate(auto_wrap_policy: AutoWrapPolicy) -> Callable[[str, nn.Module], bool]:
    """``(path, module) -> is it a unit`` for submodules, from an ``auto_wrap_policy``.

    Raises:
        ConfigurationError: the policy is none of None, module classes or a callable.
    """
    if auto_wrap_policy is None:
        return lambda path, module: "." not in path and _holds_parameters(module)
    if isinstance(auto_wrap_policy, type) and issubclass(auto_wrap_policy, nn.Module):
        auto_wrap_policy = (auto_wrap_policy,)
    if isinstance(auto_wrap_policy, list | tuple | set | frozenset):
        classes = tuple(auto_wrap_policy)
        if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module)
                                  for c in classes):
            raise ConfigurationError(
                f"auto_wrap_policy as a collection must hold torch.nn.Module classes, got "
                f"{auto_wrap_policy!r}"
            )
        return lambda path, module: isinstance(module, classes)
    if callable(auto_wrap_policy):
        policy = auto_wrap_policy
        return lambda path, module: bool(policy(module))
    raise ConfigurationError(
        "auto_wrap_policy must be None, a list of torch.nn.Module classes or a callable "
        f"policy(module) -> bool, got {type(auto_wrap_policy).__name__}"
    )


def plan_units(root: nn.Module, auto_wrap_policy: AutoWrapPolicy = None) -> list[UnitPlan]:
    """The sharding units of ``root`` under ``auto_wrap_policy`` (see the module docstring).

    Raises:
        ConfigurationError: an invalid policy, or a unit whose parameters mix dtypes or mix
            trainable and frozen parameters.
    """
    is_unit = wrap_predicate(auto_wrap_policy)
    paths = list(root.named_modules(remove_duplicate=False))  # pre-order: parents first
    units: dict[int, tuple[str, nn.Module]] = {id(root): ("", root)}
    for path, module in paths[1:]:
        if id(module) not in units and is_unit(path, module):
            units[id(module)] = (path, module)

    # For every path, the chain of units enclosing it, outermost first.
    chains: dict[str, tuple[int, ...]] = {"": (id(root),)}
    for path, module in paths[1:]:
        parent = chains[path.rpartition(".")[0]]
        chains[path] = (*parent, id(module)) if id(module) in units else parent

    found: dict[int, dict] = {}  # id(param) -> what we learn about it, in registration order
    for path, module in paths:
        for attr, param in module._parameters.items():
            if param is None:
                continue
            entry = found.setdefault(id(param), {"param": param, "names": [], "slots": [],
                                                 "chains": []})
            entry["names"].append(f"{path}.{attr}" if path else attr)
            if not any(m is module and a == attr for m, a in entry["slots"]):
                entry["slots"].append((module, attr))
            entry["chains"].append(chains[path])

    owned: dict[int, list[PlannedParam]] = {uid: [] for uid in units}
    for entry in found.values():
        owner = _innermost_common(entry["chains"])
        owned[owner].append(PlannedParam(entry["names"][0], entry["param"],
                                         tuple(dict.fromkeys(entry["names"])),
                                         tuple(entry["slots"])))
    plans = [UnitPlan(units[uid][0], units[uid][1], tuple(params))
             for uid, params in owned.items() if params]
    for plan in plans:
        _check_uniform(plan)
    return plans


def _holds_parameters(module: nn.Module) -> bool:
    return next(iter(module.parameters()), None) is not None


def _innermost_common(chains: list[tuple[int, ...]]) -> int:
    common = chains[0]
    for chain in chains[1:]:
        n = 0
        while n < min(len(common), len(chain)) and common[n] == chain[n]:
            n += 1
        common = common[:n]
    return common[-1]  # every chain starts at the root


def _check_uniform(plan: UnitPlan) -> None:
    first = plan.params[0]
    for p in plan.params[1:]:
        if p.param.dtype != first.param.dtype:
            raise ConfigurationError(
                f"sharding unit {plan.label} mixes dtypes: {first.name} is "
                f"{first.param.dtype}, {p.name} is {p.param.dtype}; a unit is one flat buffer "
                "of one dtype, so give these parameters their own units (auto_wrap_policy)"
            )
        if p.param.requires_grad != first.param.requires_grad:
            frozen, trained = (p, first) if first.param.requires_grad else (first, p)
            raise ConfigurationError(
                f"sharding unit {plan.label} mixes frozen and trainable parameters "
                f"({frozen.name} is frozen, {trained.name} is not); a unit has one gradient, "
                "so give the frozen parameters their own units (auto_wrap_policy)"
            )


__all__ = ["AutoWrapPolicy", "PlannedParam", "UnitPlan", "plan_units", "wrap_predicate"]
