"""DataParallel in one process on CPU replicas (no process group, no sockets): training equals
the plain module's on the whole batch, and the scatter, replicate and gather rules hold."""

from __future__ import annotations

import copy
import threading
from collections import namedtuple

import pytest
import torch
from torch import nn

import gradstar
from gradstar.client.data_parallel import gather, replicate, scatter
from gradstar.errors import ConfigurationError

CPU2 = ["cpu", "cpu"]
# float32 training: the replicas' gradients are summed in another order than the whole batch's.
RTOL, ATOL = 1e-5, 1e-7
Pair = namedtuple("Pair", "out hidden")


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(),
                         nn.Linear(12, 3))


def data(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(31 * step + rows)
    return torch.randn(rows, 5, generator=g), torch.randn(rows, 3, generator=g)


def train(model, opt, sizes) -> list[float]:
    losses = []
    for step, rows in enumerate(sizes):
        x, y = data(step, rows)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("devices", [CPU2, [torch.device("cpu")] * 3])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_training_on_cpu_replicas_equals_the_plain_module_on_the_whole_batch(devices, kind):
    # Uneven splits (9 rows on 2 or 3 replicas) and batches smaller than the replica count.
    sizes = [8, 9, 16, 2, 1, 11]
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adam": lambda p: torch.optim.Adam(p, lr=0.01)}[kind]
    plain, wrapped = mlp(), mlp()
    model = gradstar.DataParallel(wrapped, device_ids=devices)
    want = train(plain, make(plain.parameters()), sizes)
    got = train(model, make(model.parameters()), sizes)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for (name, p), q in zip(wrapped.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=name)
        assert p.data_ptr() != q.data_ptr()
    assert list(model.state_dict()) == ["module." + k for k in plain.state_dict()]


def test_training_moved_the_parameters_so_the_equality_above_is_not_trivial():
    before, after = mlp(), mlp()
    train(gradstar.DataParallel(after, CPU2), torch.optim.SGD(after.parameters(), lr=0.1),
          [8, 8])
    assert not torch.allclose(before[0].weight, after[0].weight)


def test_the_batch_is_split_into_near_equal_shards_and_smaller_batches_use_fewer_replicas():
    devices = [torch.device("cpu")] * 4
    sizes = {rows: [args[0].shape[0] for args, _ in scatter((torch.zeros(rows, 2),), {},
                                                           devices)]
             for rows in (10, 8, 3, 1, 0)}
    assert sizes == {10: [3, 3, 2, 2], 8: [2, 2, 2, 2], 3: [1, 1, 1], 1: [1], 0: [0]}


def test_nested_arguments_are_scattered_and_other_values_passed_to_every_replica():
    x = torch.arange(12.0).reshape(6, 2)
    shards = scatter(({"x": x, "ids": [torch.arange(6)]}, "tag"),
                     {"scale": torch.tensor(2.0), "n": 3}, [torch.device("cpu")] * 2)
    (args0, kwargs0), (args1, kwargs1) = shards
    assert torch.equal(args0[0]["x"], x[:3]) and torch.equal(args1[0]["x"], x[3:])
    assert torch.equal(args1[0]["ids"][0], torch.arange(3, 6))
    assert args0[1] == args1[1] == "tag"
    assert kwargs0["n"] == kwargs1["n"] == 3 and float(kwargs1["scale"]) == 2.0


class Structured(nn.Module):
    """Returns a dict holding a namedtuple, a list, a 0-d loss, None and a string."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, *, target):
        out = self.lin(x)
        return {"pair": Pair(out, x * 2), "parts": [out.sum(1)], "loss": ((out - target) ** 2)
                .mean(), "none": None, "note": "rows"}


def test_dict_namedtuple_and_list_outputs_are_gathered_into_the_same_structure():
    module = Structured()
    model = gradstar.DataParallel(module, CPU2)
    x, target = torch.randn(5, 4), torch.randn(5, 2)
    got = model(x, target=target)
    want = module(x, target=target)
    assert isinstance(got["pair"], Pair) and isinstance(got["parts"], list)
    torch.testing.assert_close(got["pair"].out, want["pair"].out)
    torch.testing.assert_close(got["pair"].hidden, x * 2)
    torch.testing.assert_close(got["parts"][0], want["parts"][0])
    # A 0-d output becomes one entry per replica, as with torch's DataParallel.
    assert got["loss"].shape == (2,)
    halves = [((module.lin(x[s]) - target[s]) ** 2).mean() for s in (slice(0, 3), slice(3, 5))]
    torch.testing.assert_close(got["loss"], torch.stack(halves))
    assert got["none"] is None and got["note"] == ["rows", "rows"]


def test_replicas_that_return_differently_structured_outputs_are_a_named_error():
    class Ragged(nn.Module):
        def forward(self, x):
            return (x,) if x.shape[0] > 1 else (x, x)

    with pytest.raises(ConfigurationError, match=r"cannot gather output: the replicas returned "
                                                 r"differently structured values \(tuple of 1, "
                                                 r"tuple of 2\)"):
        gradstar.DataParallel(Ragged(), CPU2)(torch.zeros(3, 1))
    with pytest.raises(ConfigurationError, match=r"output\['a'\]"):
        gather([{"a": torch.zeros(1)}, {"a": 1}], torch.device("cpu"))


class Recorder(nn.Module):
    """Records, per forward, its thread's name, grad mode and the rows it saw; counts forwards in a
    buffer (in place, as batch norm updates its statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("offset", torch.zeros(3))
        self.seen: list = []
        self.lock = threading.Lock()

    def forward(self, x):
        with self.lock:
            self.seen.append((threading.current_thread().name, torch.is_grad_enabled(), x.shape[0]))
        self.calls += 1
        return self.lin(x) + self.offset


def test_replicas_run_on_threads_of_their_own_with_the_callers_grad_mode():
    module = Recorder()
    model = gradstar.DataParallel(module, [torch.device("cpu")] * 3)
    out = model(torch.randn(7, 3))
    assert out.requires_grad
    # Replica 0 on this thread, the others on theirs (names: idents may be reused).
    assert sorted(name for name, _, _ in module.seen) == sorted(
        [threading.current_thread().name, "gradstar-dp-replica-1", "gradstar-dp-replica-2"])
    assert sorted(rows for _, _, rows in module.seen) == [2, 2, 3]
    module.seen.clear()
    with torch.no_grad():
        out = model(torch.randn(7, 3))
    assert not out.requires_grad and [grad for _, grad, _ in module.seen] == [False] * 3


def test_buffers_come_from_the_primary_each_forward_and_only_replica_0s_updates_stay():
    module = Recorder()
    model = gradstar.DataParallel(module, [torch.device("cpu")] * 3)
    model(torch.randn(6, 3))
    assert int(module.calls) == 1  # replica 0 is the primary; the others' counts are dropped
    with torch.no_grad():
        module.offset.fill_(100.0)
    x = torch.randn(6, 3)
    torch.testing.assert_close(model(x), module.lin(x) + 100.0)  # every replica saw it
    assert int(module.calls) == 2


def test_replicas_compute_with_the_primarys_current_parameters():
    module = mlp()
    model = gradstar.DataParallel(module, CPU2)
    x = torch.randn(4, 5)
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(-0.5)
    torch.testing.assert_close(model(x), module(x))  # rows 2-3 ran on replica 1's copy


def test_replicas_are_copies_whose_gradients_reach_the_primary_only():
    module = mlp()
    [replica] = replicate(module, [torch.device("cpu")])
    own = dict(module.named_parameters())
    for name, p in replica.named_parameters():
        assert p.data_ptr() != own[name].data_ptr() and p.grad_fn is not None
    replica(torch.randn(2, 5)).sum().backward()
    assert all(p.grad is not None for p in module.parameters())
    assert list(replica.state_dict()) == list(module.state_dict())


def test_gradients_reach_inputs_that_require_them():
    module = mlp()
    x = torch.randn(5, 5, requires_grad=True)
    gradstar.DataParallel(module, CPU2)(x).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    module(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_an_error_in_a_replica_names_the_replica_and_its_device():
    class Picky(nn.Module):
        def forward(self, x):
            if x[0, 0] > 0:
                raise ValueError("positive first row")
            return x

    x = torch.tensor([[-1.0], [1.0]])
    with pytest.raises(ValueError, match="positive first row") as raised:
        gradstar.DataParallel(Picky(), CPU2)(x)
    assert raised.value.__notes__ == ["raised in DataParallel's replica 1 on cpu"]


def test_no_devices_is_a_named_error(monkeypatch):
    with pytest.raises(ConfigurationError, match="DataParallel has no devices: device_ids is "
                                                 "empty"):
        gradstar.DataParallel(mlp(), device_ids=[])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigurationError, match="DataParallel has no devices: device_ids=None "
                                                 "means every visible CUDA device and this "
                                                 "process sees none"):
        gradstar.DataParallel(mlp())


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"device_ids": "cpu"}, r"device_ids must be a list of devices, got str 'cpu'"),
    ({"device_ids": ["meta"]}, r"onto the CPU or CUDA devices, not meta"),
    ({"device_ids": ["cpu", True]}, r"True is not a device"),
    ({"device_ids": ["cpu", "gpu"]}, r"'gpu' is not a device"),
    ({"device_ids": ["cpu"], "output_device": "mps"}, r"output_device: .* not mps"),
])
def test_devices_other_than_cpu_and_cuda_are_refused(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        gradstar.DataParallel(mlp(), **kwargs)


def test_a_cuda_device_this_process_does_not_see_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigurationError, match=r"cuda:7 is not a visible device \(this "
                                                 r"process sees 0 CUDA device\(s\)\)"):
        gradstar.DataParallel(mlp(), device_ids=["cpu", 7])


def test_a_module_on_another_kind_of_device_is_refused():
    # A CUDA module with CPU device_ids: tests/cuda/test_data_parallel_cuda.py.
    with pytest.raises(ConfigurationError, match=r"DataParallel runs on the CPU or a CUDA "
                                                 r"device; parameter 0.weight is on meta"):
        gradstar.DataParallel(copy.deepcopy(mlp()).to("meta"), CPU2)


class Scaled(nn.Module):
    """An MLP whose forward takes a keyword too, to see kwargs reach their replica."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x, scale=1.0):
        return self.net(x) * scale


@pytest.mark.parametrize("replicas", [2, 3])
def test_forward_parallel_equals_the_plain_module_per_input(replicas):
    plain, wrapped = Scaled(), Scaled()
    model = gradstar.DataParallel(wrapped, device_ids=["cpu"] * replicas)
    # Inputs of different sizes, none split: one per device, each as the plain module sees it.
    xs = [data(i, rows)[0] for i, rows in enumerate([4, 1, 7][:replicas])]
    inputs = [x if i % 2 else (x,) for i, x in enumerate(xs)]  # one argument, or a tuple
    kwargs = [{"scale": 0.5 + i} for i in range(replicas)]
    outputs = model.forward_parallel(inputs, kwargs)
    assert len(outputs) == replicas
    wants = [plain(x, scale=0.5 + i) for i, x in enumerate(xs)]
    for got, want in zip(outputs, wants, strict=True):
        torch.testing.assert_close(got, want)
    # Backward sums each replica's gradient into the wrapped module, as the plain sum does.
    sum(o.square().sum() for o in outputs).backward()
    sum(w.square().sum() for w in wants).backward()
    for (name, p), q in zip(wrapped.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize(("inputs", "kwargs", "message"), [
    ([torch.ones(2, 5)], None, r"one entry of inputs per device: got 1 for 2 devices \(cpu, cpu\)"),
    ([torch.ones(2, 5)] * 3, None, "one entry of inputs per device: got 3 for 2 devices"),
    ([torch.ones(2, 5)] * 2, [{}], "one entry of kwargs per device: got 1 for 2 devices"),
])
def test_forward_parallel_checks_the_count_by_name(inputs, kwargs, message):
    model = gradstar.DataParallel(mlp(), device_ids=CPU2)
    with pytest.raises(ConfigurationError,
                       match=r"DataParallel\.forward_parallel takes " + message):
        model.forward_parallel(inputs, kwargs)


def test_sync_modes_need_a_process_group():
    hint = (r"needs a process_group: a sync mode decides when a step of several processes is "
            r"complete")
    with pytest.raises(ConfigurationError, match=r"DataParallel\.sync_mode= or optimizer= " + hint):
        gradstar.DataParallel(mlp(), device_ids=CPU2, sync_mode=gradstar.Quorum(min_ranks=1))
    model = gradstar.DataParallel(mlp(), device_ids=CPU2)
    assert model.sync_mode == gradstar.Synchronous() and model.sync_stats() is None
    with pytest.raises(ConfigurationError, match=r"DataParallel\.set_sync_mode\(\) " + hint):
        model.set_sync_mode(gradstar.Asynchronous())
    model.synchronize()  # nothing to wait for
