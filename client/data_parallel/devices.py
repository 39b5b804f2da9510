"""Which devices :class:`~gradstar.client.data_parallel.DataParallel` replicates onto.

``device_ids`` names CUDA devices by index (``0`` is ``cuda:0``, as in torch), or any device
by ``torch.device`` or its string (``"cuda:1"``, ``"cpu"``). CPU replicas are allowed, so that
the whole machinery runs without a GPU: ``["cpu", "cpu"]`` is two replicas on the CPU (they
share its cores, so it is for tests and for checking a model, not for speed). A device may be
named more than once: each entry is one replica (``["cuda:0", "cuda:0"]`` runs two replicas on
one GPU). Other device types (mps, xpu, meta, ...) are refused, as everywhere in gradstar.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gradstar.errors import ConfigurationError

#: What names one device: a CUDA index, a ``torch.device`` or its string.
DeviceLike = int | str | torch.device


def resolve_devices(device_ids: Iterable[DeviceLike] | None) -> list[torch.device]:
    """The replicas' devices: ``device_ids`` resolved, or every visible CUDA device for None.

    Raises:
        ConfigurationError: no devices (an empty list, or None on a machine without a visible
            CUDA device), or an entry that is not a CPU or visible CUDA device (named).
    """
    if device_ids is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigurationError(
                "DataParallel has no devices: device_ids=None means every visible CUDA device "
                "and this process sees none; pass device_ids=['cpu', 'cpu'] for CPU replicas")
        return [torch.device("cuda", i) for i in range(count)]
    if isinstance(device_ids, (int, str, torch.device)) or not isinstance(device_ids, Iterable):
        raise ConfigurationError(
            f"device_ids must be a list of devices, got {type(device_ids).__name__} "
            f"{device_ids!r}; for one device pass [{device_ids!r}]")
    devices = [resolve_device(d, "device_ids") for d in device_ids]
    if not devices:
        raise ConfigurationError(
            "DataParallel has no devices: device_ids is empty; name at least one device "
            "(a CUDA index, 'cuda:N' or 'cpu')")
    return devices


def resolve_device(device: DeviceLike, what: str = "device") -> torch.device:
    """One device: an int is a CUDA index, a string or ``torch.device`` is taken as given
    (``"cuda"`` is the current CUDA device).

    Raises:
        ConfigurationError: not a device, a type other than CPU and CUDA, or a CUDA device
            this process does not see.
    """
    if isinstance(device, bool):
        raise ConfigurationError(f"{what}: {device!r} is not a device")
    try:
        resolved = torch.device("cuda", device) if isinstance(device, int) else \
            torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigurationError(
            f"{what}: {device!r} is not a device; use a CUDA index, 'cuda:N' or 'cpu'") from None
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type != "cuda":
        raise ConfigurationError(
            f"{what}: DataParallel replicates onto the CPU or CUDA devices, not {resolved}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = resolved.index if resolved.index is not None else (
        torch.cuda.current_device() if count else 0)
    if not 0 <= index < count:
        raise ConfigurationError(
            f"{what}: cuda:{index} is not a visible device (this process sees {count} CUDA "
            "device(s))")
    return torch.device("cuda", index)


__all__ = ["DeviceLike", "resolve_device", "resolve_devices"]
