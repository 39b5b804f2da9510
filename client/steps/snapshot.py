"""A rank's whole training state as bytes and a JSON layout, without pickle: what the hub keeps
for ranks that join mid-training (``gradstar.coordinator.steps``, Snapshots).

The state is the module's ``state_dict()`` (parameters and buffers) and the optimizer's
``state_dict()``. Tensors become entries of the layout (dtype, shape, offset, length) over one
byte string; everything else in the optimizer's dict (learning rates, betas, flags) must be
JSON: numbers, strings, booleans, None, lists and dicts. :func:`unpack` checks every entry
against the byte string before it makes a tensor, so a bad snapshot is a named error.
"""

from __future__ import annotations

import json

import torch

from gradstar.errors import ConfigurationError, ProtocolError

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
    """Load a snapshot made by :func:`pack` into ``module`` and ``optimizer``.

    Raises:
        ProtocolError: the layout is malformed or points outside the data.
        RuntimeError: the state does not fit the module or optimizer (torch's own message).
    """

    def decode(node):
        if not isinstance(node, dict) or len(node) == 0:
            raise ProtocolError("a snapshot's layout is malformed")
        if "tensor" in node:
            dtype = DTYPES.get(node["tensor"])
            start, n, shape = node.get("offset"), node.get("nbytes"), node.get("shape")
            if dtype is None or not isinstance(start, int) or not isinstance(n, int) or (
                    start < 0 or start + n > len(data)) or not isinstance(shape, list):
                raise ProtocolError("a snapshot's layout points outside its data")
            raw = torch.frombuffer(bytearray(data[start:start + n]), dtype=torch.uint8) if n \
                else torch.empty(0, dtype=torch.uint8)
            try:
                return raw.view(dtype).reshape(shape).clone()
            except RuntimeError as error:
                raise ProtocolError(f"a snapshot tensor does not match its shape: {error}") \
                    from None
        if "dict" in node:
            return {_key(decode(k)): decode(v) for k, v in node["dict"]}
        if "list" in node:
            return [decode(v) for v in node["list"]]
        return node.get("value")

    try:
        tree = json.loads(layout)
        module_state, optimizer_state = decode(tree["module"]), decode(tree["optimizer"])
    except (ValueError, KeyError, TypeError) as error:
        raise ProtocolError(f"a snapshot's layout is malformed: {error}") from None
    module.load_state_dict(module_state)
    optimizer.load_state_dict(optimizer_state)


def _key(value):
    return tuple(value) if isinstance(value, list) else value
