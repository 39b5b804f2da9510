"""A rank's whole training state as bytes and a JSON layout, without pickle: what the hub keeps
for ranks that join mid-training (``gradstar.coordinator.steps``, Snapshots).

The state is the module's ``state_dict()`` (parameters and buffers) and the optimizer's
``state_dict()``. Tensors become entries of the layout (dtype, shape, offset, length) over one
byte string; everything else in the optimizer's dict (learning rates, betas, flags) must be
JSON: numbers, strings, booleans, None, lists and dicts. :func:`unpack` checks the whole
layout against the byte string, the module and the optimizer before it makes a tensor or loads
anything, so a bad snapshot is a named error and changes nothing.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass

import torch

from gradstar.errors import ConfigurationError, ProtocolError

#: Deepest a layout may nest (a module's and an optimizer's state take about 6 levels).
MAX_DEPTH = 32
#: dtypes a snapshot carries (by name).
DTYPES = {str(t).removeprefix("torch."): t for t in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


def pack(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[str, bytes]:
    """(layout, data) of the module's and the optimizer's state, copied now.

    Raises:
        ConfigurationError: a value the layout cannot carry (a dtype or a Python object).
    """
    chunks: list[bytes] = []
    offset = 0

    def encode(value):
        nonlocal offset
        if isinstance(value, torch.Tensor):
            name = str(value.dtype).removeprefix("torch.")
            if name not in DTYPES:
                raise ConfigurationError(f"a snapshot cannot carry a tensor of dtype {name}")
            raw = value.detach().cpu().contiguous()
            data = raw.reshape(-1).view(torch.uint8).numpy().tobytes() if raw.numel() else b""
            entry = {"tensor": name, "shape": list(raw.shape), "offset": offset,
                     "nbytes": len(data)}
            chunks.append(data)
            offset += len(data)
            return entry
        if isinstance(value, dict):
            return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
        if isinstance(value, list | tuple):
            return {"list": [encode(v) for v in value]}
        if value is None or isinstance(value, bool | int | float | str):
            return {"value": value}
        raise ConfigurationError(f"a snapshot cannot carry a {type(value).__name__} "
                                 "(optimizer state must be tensors, numbers and strings)")

    layout = {"module": encode(module.state_dict()), "optimizer": encode(optimizer.state_dict())}
    return json.dumps(layout), b"".join(chunks)


def unpack(layout: str, data: bytes, module: torch.nn.Module,
           optimizer: torch.optim.Optimizer) -> None:
    """Load a snapshot made by :func:`pack` into ``module`` and ``optimizer``, after checking
    all of it: a snapshot comes from the hub, which keeps it opaque, so nothing in it is
    trusted. Every tensor entry must name a carried dtype, a shape, and a span of exactly that
    shape's bytes inside ``data``, no two spans overlapping (so the tensors made take at most
    ``data``'s size); the module's entries must be its own state dict's names with their
    dtypes and shapes; the optimizer's per-parameter tensors must fit their parameters; the
    layout nests at most ``MAX_DEPTH`` levels. Nothing is loaded unless every check passes.

    Raises:
        ProtocolError: the layout is malformed, nests too deep, points outside the data, has
            overlapping entries, or does not fit the module or the optimizer; it names the
            entry. Neither the module nor the optimizer changed then.
    """
    try:
        tree = json.loads(layout)
    except RecursionError:
        raise ProtocolError(f"a snapshot's layout nests deeper than {MAX_DEPTH} levels") \
            from None
    except ValueError as error:
        raise ProtocolError(f"a snapshot's layout is malformed (not JSON: {error})") from None
    if not isinstance(tree, dict) or set(tree) != {"module", "optimizer"}:
        raise ProtocolError("a snapshot's layout must hold exactly 'module' and 'optimizer'")
    entries: list[_Entry] = []
    module_state = _decode(tree["module"], "module", 0, len(data), entries)
    optimizer_state = _decode(tree["optimizer"], "optimizer", 0, len(data), entries)
    _check_no_overlap(entries)
    _check_module(module_state, module)
    _check_optimizer(optimizer_state, optimizer)
    module_state = _materialize(module_state, data)
    optimizer_state = _materialize(optimizer_state, data)
    try:  # checks before it changes anything (torch's own order)
        optimizer.load_state_dict(optimizer_state)
    except (ValueError, KeyError, TypeError, RuntimeError) as error:
        raise ProtocolError(f"a snapshot's optimizer state does not fit the optimizer: "
                            f"{error}") from None
    module.load_state_dict(module_state)  # checked above: every name, dtype and shape


@dataclass(frozen=True)
class _Entry:
    """A tensor of the layout, not yet made: where it is in the data, and what it is."""

    where: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


_TENSOR_KEYS = frozenset({"tensor", "shape", "offset", "nbytes"})


def _decode(node, where: str, depth: int, size: int, entries: list[_Entry]):
    """``node`` of the layout as Python values, its tensors as :class:`_Entry` (collected
    in ``entries``).

    Raises:
        ProtocolError: as :func:`unpack`, naming ``where``.
    """
    if depth > MAX_DEPTH:
        raise ProtocolError(f"a snapshot's layout nests deeper than {MAX_DEPTH} levels at "
                            f"{where}")
    if not isinstance(node, dict) or not node:
        raise ProtocolError(f"snapshot entry {where} is malformed")
    if "tensor" in node:
        entry = _tensor_entry(node, where, size)
        entries.append(entry)
        return entry
    if len(node) != 1:
        raise ProtocolError(f"snapshot entry {where} is malformed")
    if "dict" in node and isinstance(node["dict"], list):
        out = {}
        for i, pair in enumerate(node["dict"]):
            if not isinstance(pair, list) or len(pair) != 2:
                raise ProtocolError(f"snapshot entry {where} is malformed at item {i}")
            key = _decode(pair[0], f"{where}[key {i}]", depth + 1, size, entries)
            key = tuple(key) if isinstance(key, list) else key
            if not _plain_key(key):
                raise ProtocolError(f"snapshot entry {where} has a key that is not a name or "
                                    f"a number at item {i}")
            out[key] = _decode(pair[1], f"{where}[{key!r}]", depth + 1, size, entries)
        return out
    if "list" in node and isinstance(node["list"], list):
        return [_decode(v, f"{where}[{i}]", depth + 1, size, entries)
                for i, v in enumerate(node["list"])]
    if "value" in node and (node["value"] is None or isinstance(node["value"],
                                                                bool | int | float | str)):
        return node["value"]
    raise ProtocolError(f"snapshot entry {where} is malformed")


def _plain_key(key) -> bool:
    if isinstance(key, tuple):
        return all(_plain_key(k) for k in key)
    return key is None or isinstance(key, bool | int | float | str)


def _tensor_entry(node: dict, where: str, size: int) -> _Entry:
    dtype = DTYPES.get(node.get("tensor")) if isinstance(node.get("tensor"), str) else None
    shape, start, n = node.get("shape"), node.get("offset"), node.get("nbytes")
    if set(node) != _TENSOR_KEYS or dtype is None:
        raise ProtocolError(f"snapshot entry {where} is not a tensor of a carried dtype "
                            f"({', '.join(sorted(DTYPES))})")
    if not isinstance(shape, list) or not all(_count(d) for d in shape) or not (
            _count(start) and _count(n)):
        raise ProtocolError(f"snapshot entry {where} has a malformed shape, offset or size")
    expected = math.prod(shape) * dtype.itemsize
    if n != expected:
        raise ProtocolError(f"snapshot entry {where} of shape {shape} in {node['tensor']} "
                            f"takes {expected} bytes, but says {n}")
    if start + n > size:
        raise ProtocolError(f"snapshot entry {where} spans bytes {start}-{start + n}, outside "
                            f"the snapshot's {size} bytes of data")
    return _Entry(where, dtype, tuple(shape), start, n)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_no_overlap(entries: list[_Entry]) -> None:
    spans = sorted((e for e in entries if e.nbytes), key=lambda e: e.start)
    for before, after in itertools.pairwise(spans):
        if after.start < before.start + before.nbytes:
            raise ProtocolError(f"snapshot entries {before.where} and {after.where} overlap in "
                                "the data; each tensor has bytes of its own")


def _check_module(state, module: torch.nn.Module) -> None:
    if not isinstance(state, dict):
        raise ProtocolError("a snapshot's module state is not a dict of tensors")
    own = module.state_dict()
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own), key=str)
    if missing or extra:
        raise ProtocolError(f"a snapshot's module state does not fit the module: missing "
                            f"{missing or 'none'}, unexpected {extra or 'none'}")
    for name, tensor in own.items():
        entry = state[name]
        if not isinstance(entry, _Entry) or entry.dtype != tensor.dtype or (
                entry.shape != tuple(tensor.shape)):
            what = (f"{str(entry.dtype).removeprefix('torch.')} {list(entry.shape)}"
                    if isinstance(entry, _Entry) else "not a tensor")
            raise ProtocolError(
                f"snapshot entry module[{name!r}] is {what}, but the module's is "
                f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}")


def _check_optimizer(state, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state: torch's layout (``state`` by parameter index, ``param_groups``
    with their ``params``), each parameter's tensors no larger than it (the same shape where
    they have as many dimensions: momentum, Adam's moments)."""
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict) or (
            not isinstance(state.get("param_groups"), list)):
        raise ProtocolError("a snapshot's optimizer state is not torch's (a dict of 'state' "
                            "and 'param_groups')")
    saved = []
    for group in state["param_groups"]:
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise ProtocolError("a snapshot's optimizer param_groups are malformed")
        saved.extend(group["params"])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(saved) != len(params):
        raise ProtocolError(f"a snapshot's optimizer has {len(saved)} parameters, this one "
                            f"{len(params)}")
    by_id = dict(zip(saved, params, strict=True))
    for index, values in state["state"].items():
        param = by_id.get(index)
        if param is None or not isinstance(values, dict):
            raise ProtocolError(f"snapshot entry optimizer['state'][{index!r}] is not the "
                                "state of one of the optimizer's parameters")
        for value in values.values():
            if isinstance(value, _Entry) and value.shape and not _fits(value.shape, param):
                raise ProtocolError(
                    f"snapshot entry {value.where} has shape {list(value.shape)}, which does "
                    f"not fit its parameter of shape {list(param.shape)}")


def _fits(shape: tuple[int, ...], param: torch.Tensor) -> bool:
    if len(shape) == param.dim():
        return shape == tuple(param.shape)
    return math.prod(shape) <= param.numel()


def _materialize(node, data: bytes):
    """``node`` with each :class:`_Entry` made a tensor (a copy of its bytes)."""
    if isinstance(node, _Entry):
        if not node.nbytes:
            return torch.empty(node.shape, dtype=node.dtype)
        raw = torch.frombuffer(bytearray(memoryview(data)[node.start:node.start + node.nbytes]),
                               dtype=torch.uint8)
        return raw.view(node.dtype).reshape(node.shape)
    if isinstance(node, dict):
        return {k: _materialize(v, data) for k, v in node.items()}
    if isinstance(node, list):
        return [_materialize(v, data) for v in node]
    return node
