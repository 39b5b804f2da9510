"""What gradstar's torch wrappers (DDP, FSDP, Pipeline, LocalSGD) share: the dtypes gradients
travel in, the checks every wrapper makes of its arguments (the module's one device among them),
and the broadcast of rank 0's state at construction.

Siblings import these from here, never from each other (``ddp`` and ``fsdp`` stay independent).
"""

from __future__ import annotations

import torch
from torch import nn

from gradstar.errors import ConfigurationError

from .buckets import BucketPlan, TensorSpec
from .device import is_staged
from .process_group.protocol import CollectiveGroup

#: ``gradient_compression`` / ``mixed_precision`` names -> the dtype gradients travel in.
COMPRESSION = {
    None: None,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
#: Parameter dtypes whose gradients the hub can reduce.
GRAD_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_WIRE_DTYPES = (*GRAD_DTYPES, torch.int32, torch.int64)
# Buffers of dtypes the wire lacks travel in a wider integer type and are cast back.
_WIDENED = {torch.bool: torch.int32, torch.uint8: torch.int32, torch.int8: torch.int32,
            torch.int16: torch.int32}


def check_wrapper_arguments(wrapper: str, module, pg) -> torch.device:
    """The checks every wrapper makes: a blocking process group (a
    :class:`~gradstar.client.process_group.protocol.CollectiveGroup`), an ``nn.Module`` whose
    parameters and buffers are all on the CPU or all on one CUDA device.

    Returns:
        That device (:func:`module_device`).

    Raises:
        ConfigurationError: naming the wrapper and what is wrong.
    """
    if not isinstance(pg, CollectiveGroup):
        raise ConfigurationError(
            f"{wrapper} needs the blocking gradstar.ProcessGroup from "
            f"gradstar.init_process_group(), got {type(pg).__name__}: its gradient hooks run "
            "inside autograd and cannot await"
        )
    return module_device(wrapper, module)


def module_device(wrapper: str, module) -> torch.device:
    """The one device the ``nn.Module`` ``module``'s parameters and buffers live on: the CPU or
    a CUDA device (the CPU for a module that has neither). The wrapper keeps its buffers there,
    and what it receives from the wire is copied there.

    Raises:
        ConfigurationError: ``module`` is not an ``nn.Module``; a parameter or buffer is on
            another kind of device (mps, xpu, meta, ...), or they are spread over several
            devices. The message names the wrapper, the tensors and the devices.
    """
    if not isinstance(module, nn.Module):
        raise ConfigurationError(f"{wrapper} wraps a torch.nn.Module, got {type(module).__name__}")
    found: tuple[str, torch.device] | None = None
    for kind, named in (("parameter", module.named_parameters()),
                        ("buffer", module.named_buffers())):
        for name, t in named:
            if t.device.type != "cpu" and not is_staged(t):
                raise ConfigurationError(
                    f"{wrapper} runs on the CPU or a CUDA device; {kind} {name} is on "
                    f"{t.device}: move the module to one of them first"
                )
            if found is None:
                found = (f"{kind} {name}", t.device)
            elif t.device != found[1]:
                raise ConfigurationError(
                    f"{wrapper} needs all of a module's parameters and buffers on one device; "
                    f"{found[0]} is on {found[1]}, {kind} {name} on {t.device}: move the "
                    "whole module with .to(device) first"
                )
    return torch.device("cpu") if found is None else found[1]


def wire_dtype_of(option: str, value) -> torch.dtype | None:
    """The dtype named by a ``gradient_compression`` / ``mixed_precision`` option.

    Raises:
        ConfigurationError: an unknown name.
    """
    try:
        return COMPRESSION[value]
    except (KeyError, TypeError):
        raise ConfigurationError(
            f"{option} must be None, 'bf16' or 'fp16', got {value!r}") from None


def broadcast_from_rank0(pg: CollectiveGroup, tensors: list[torch.Tensor], cap_bytes: int, *,
                         src: int = 0) -> None:
    """Overwrite ``tensors`` with rank 0's values (rank ``src``'s, when given): flat per-dtype
    buckets, broadcast together.

    Raises:
        ConfigurationError: a tensor's dtype cannot travel (complex, for instance).
        CollectiveError and subclasses: a broadcast failed.
    """
    unique = [t for t in {id(t): t for t in tensors}.values() if t.numel()]
    if not unique:
        return
    wire = []
    for t in unique:
        dtype = t.dtype if t.dtype in _WIRE_DTYPES else _WIDENED.get(t.dtype)
        if dtype is None:
            raise ConfigurationError(
                f"cannot broadcast a tensor of dtype {t.dtype} from rank 0; supported: "
                "floating, integer and bool"
            )
        wire.append(dtype)
    plan = BucketPlan([TensorSpec(t.numel(), torch.empty(0, dtype=d).element_size(), d)
                       for t, d in zip(unique, wire, strict=True)], cap_bytes, reverse=False)
    works = []
    with torch.no_grad():
        for bucket in plan:
            flat = torch.cat([unique[i].detach().reshape(-1).to(bucket.dtype)
                              for i in bucket.members])
            works.append(pg.broadcast(flat, src=src, async_op=True))
        for bucket, work in zip(plan, works, strict=True):
            result = work.wait()
            for member, offset, numel in zip(bucket.members, bucket.offsets, bucket.numels,
                                             strict=True):
                target = unique[member]
                target.copy_(result[offset:offset + numel].view(target.shape))
