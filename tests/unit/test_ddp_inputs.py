"""DDP's forward moves its inputs to the module's device, as torch's DDP does with device_ids:
tensors nested in tuples, named tuples, lists and dicts; anything else as it is. The meta device
stands for a GPU (moving a CPU tensor there needs none)."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple

import torch

from gradstar.client.ddp.inputs import inputs_to_device, to_device

META = torch.device("meta")
Pair = namedtuple("Pair", "a b")


def test_tensors_in_nested_containers_move_and_the_containers_keep_their_types():
    tag = object()
    value = (torch.ones(2), [torch.zeros(3), {"k": torch.ones(1), "n": 5}],
             Pair(torch.ones(1), tag), OrderedDict(x=torch.ones(1)), "text")
    moved = to_device(value, META)
    assert type(moved) is tuple and len(moved) == 5
    assert moved[0].device == META and moved[0].shape == (2,)
    assert type(moved[1]) is list and moved[1][0].device == META
    assert moved[1][1]["k"].device == META and moved[1][1]["n"] == 5
    assert type(moved[2]) is Pair and moved[2].a.device == META and moved[2].b is tag
    assert type(moved[3]) is OrderedDict and moved[3]["x"].device == META
    assert moved[4] == "text"
    assert value[0].device.type == "cpu"  # the caller's tensors are not touched


def test_a_defaultdict_keeps_its_default_and_kwargs_move_too():
    d = defaultdict(list, t=torch.ones(1))
    inputs, kwargs = inputs_to_device((d,), {"mask": torch.ones(2, dtype=torch.bool)}, META)
    assert isinstance(inputs[0], defaultdict) and inputs[0]["missing"] == []
    assert inputs[0]["t"].device == META
    assert kwargs["mask"].device == META and kwargs["mask"].dtype == torch.bool


def test_a_tensor_already_on_the_device_is_not_copied():
    t = torch.ones(3)
    assert to_device(t, torch.device("cpu")) is t
