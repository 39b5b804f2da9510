"""A rank's state as a snapshot (gradstar.client.steps.snapshot): no pickle, every tensor and
optimizer setting back bit for bit, a malformed layout named; and when a rank sends one."""

from __future__ import annotations

import concurrent.futures
import json

import pytest
import torch
from torch import nn

from gradstar.client.steps.snapshot import pack, unpack
from gradstar.client.steps.sync import StepSync
from gradstar.errors import ConfigurationError, ProtocolError


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
    return model, opt


def test_a_snapshot_restores_the_module_and_the_optimizer_exactly():
    model, opt = trained(0)
    layout, data = pack(model, opt)
    assert b"pickle" not in data and "tensor" in layout
    other, other_opt = trained(1)
    unpack(layout, data, other, other_opt)
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    # The restored optimizer takes the same next step.
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (other, other_opt)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(),
                                                 strict=True))
    assert other_opt.param_groups[0]["betas"][0] == 0.8


def test_a_malformed_or_lying_layout_is_a_named_error():
    model, opt = trained(0)
    layout, data = pack(model, opt)
    with pytest.raises(ProtocolError, match="outside"):
        unpack(layout, data[:10], model, opt)
    with pytest.raises(ProtocolError, match="malformed"):
        unpack("{not json", data, model, opt)
    tree = json.loads(layout)
    tree["module"] = {"tensor": "complex128", "shape": [1], "offset": 0, "nbytes": 16}
    with pytest.raises(ProtocolError):
        unpack(json.dumps(tree), data, model, opt)


def _state(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            json.dumps(opt.state_dict(), default=lambda t: t.tolist()))


def _unchanged(model, opt, before) -> bool:
    params, optimizer = before
    return (all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
            and json.dumps(opt.state_dict(), default=lambda t: t.tolist()) == optimizer)


def _entries(node):
    """The layout's tensor entries (dicts), in the order pack wrote them."""
    if "tensor" in node:
        yield node
    for pair in node.get("dict", ()):
        yield from _entries(pair[1])
    for item in node.get("list", ()):
        yield from _entries(item)


def _lies():
    """Layouts a joiner may receive, each a lie about the data or the module, and the words
    its error must say (the entry it names)."""
    def relabelled(tree):  # float32 -> int32: same size, other values (1.05e9 for 0.25)
        tree["module"]["dict"][0][1]["tensor"] = "int32"

    def reshaped(tree):
        entry = tree["module"]["dict"][0][1]
        entry["shape"] = [entry["shape"][1], entry["shape"][0]]

    def overlapping(tree):  # every entry over the first one's bytes
        first = next(_entries(tree["module"]))
        for entry in _entries(tree["optimizer"]):
            entry["offset"] = first["offset"]

    def oversized(tree):
        tree["module"]["dict"][0][1]["nbytes"] += 4

    def renamed(tree):
        tree["module"]["dict"][0][0] = {"value": "not.a.parameter"}

    def not_a_dict(tree):
        tree["module"] = {"list": []}

    def deep(tree):  # too deep for json itself (written out: json.dumps cannot either)
        nested = '{"list": [' * 10_000 + '{"value": 1}' + "]}" * 10_000
        return f'{{"module": {json.dumps(tree["module"])}, "optimizer": {nested}}}'

    def moderately_deep(tree):  # parsed by json, refused by the layout's own bound
        node = {"value": 1}
        for _ in range(100):
            node = {"list": [node]}
        tree["optimizer"]["dict"][0][1] = node

    def momentum_of_another_shape(tree):
        state = tree["optimizer"]["dict"][0][1]["dict"][0][1]  # parameter 0's state
        for _, value in state["dict"]:
            if "tensor" in value and value["shape"]:
                value["shape"] = [value["shape"][0] + 1, *value["shape"][1:]]
                value["nbytes"] = 4 * value["shape"][0] * (
                    value["shape"][1] if len(value["shape"]) > 1 else 1)
                return

    return [(relabelled, r"module\['0.weight'\] is int32"),
            (reshaped, r"module\['0.weight'\] is float32 \[4, 8\]"),
            (overlapping, "overlap"), (oversized, r"module\['0.weight'\].*takes 128 bytes"),
            (renamed, "unexpected \\['not.a.parameter'\\]"), (not_a_dict, "not a dict"),
            (deep, "nests deeper"), (moderately_deep, "nests deeper"),
            (momentum_of_another_shape, r"optimizer\['state'\]\[0\]\['exp_avg'\]")]


@pytest.mark.parametrize(("lie", "words"), _lies(), ids=[f.__name__ for f, _ in _lies()])
def test_a_snapshot_that_does_not_fit_the_module_is_named_and_changes_nothing(lie, words):
    model, opt = trained(0)
    layout, data = pack(model, opt)
    joiner, joiner_opt = trained(1)
    before = _state(joiner, joiner_opt)
    tree = json.loads(layout)
    told = lie(tree) or json.dumps(tree)
    with pytest.raises(ProtocolError, match=words):
        unpack(told, data, joiner, joiner_opt)
    assert _unchanged(joiner, joiner_opt, before)


def test_state_that_is_not_tensors_numbers_or_strings_is_refused():
    model, opt = trained(0)
    opt.param_groups[0]["hook"] = object()
    with pytest.raises(ConfigurationError, match="cannot carry"):
        pack(model, opt)


class _Uploads:
    """What StepSync's snapshot sending needs of its process group and hub client: each
    put_snapshot recorded, each upload a future this test completes."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.futures: list[concurrent.futures.Future] = []

    def put_snapshot(self, steps, layout, data, timeout):
        self.sent.append(steps)
        return steps  # what _submit is given

    def submit(self, _call) -> concurrent.futures.Future:
        self.futures.append(concurrent.futures.Future())
        return self.futures[-1]


def test_a_snapshot_asked_for_during_an_upload_goes_once_that_upload_is_done():
    # The hub asks again only SNAPSHOT_EVERY steps after asking: a request dropped because the
    # previous upload was still going would leave its snapshot that many steps staler.
    model, opt = trained(0)
    hub = _Uploads()
    sync = StepSync.__new__(StepSync)
    sync.module, sync._optimizer, sync.timeout = model, opt, 5.0
    sync._client, sync._submit = hub, hub.submit
    sync._snapshot_due, sync._uploads = True, set()
    sync.have = 1
    sync._send_snapshot()
    assert hub.sent == [1] and not sync._snapshot_due
    sync.have, sync._snapshot_due = 17, True  # asked again while step 1's upload is going
    sync._send_snapshot()
    assert hub.sent == [1] and sync._snapshot_due  # one upload at a time; still due
    hub.futures[0].set_result(None)
    sync.have = 18
    sync._send_snapshot()  # the next step after it is done
    assert hub.sent == [1, 18] and not sync._snapshot_due
