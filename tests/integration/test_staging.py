"""The staged path of device tensors (host copy at call time, result copied back to the device),
run on CPU tensors by declaring the CPU a staged device: every collective and send/recv gives
the same bytes as the direct path, over a real coordinator. tests/cuda/ runs the same calls on
CUDA tensors where a GPU is present."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from gradstar.client import device

from .conftest import close_all, join_all

WORLD = 3
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]


@pytest.fixture
async def groups(coordinator):
    gs = await join_all(coordinator.address, WORLD, chunk_bytes=256)
    yield gs
    await close_all(gs)


def tensors(dtype, shape=(6, 13)):
    gen = torch.Generator().manual_seed(7)
    return [(torch.rand(shape, generator=gen) * 40 - 20).to(dtype) for _ in range(WORLD)]


async def each(groups, call):
    return await asyncio.wait_for(asyncio.gather(*(call(g) for g in groups)), 30)


async def both_paths(groups, monkeypatch, call):
    """``call`` on every rank directly, then staged; returns (direct, staged) results."""
    direct = await each(groups, call)
    with monkeypatch.context() as patch:
        patch.setattr(device, "STAGED_DEVICES", ("cuda", "cpu"))
        staged = await each(groups, call)
    return direct, staged


def assert_same(direct, staged):
    if isinstance(direct, list | tuple):
        assert len(direct) == len(staged)
        for d, s in zip(direct, staged, strict=True):
            assert_same(d, s)
        return
    assert isinstance(staged, torch.Tensor) and staged.dtype == direct.dtype
    assert staged.shape == direct.shape and staged.device == direct.device
    assert torch.equal(staged, direct)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
async def test_every_collective_gives_the_same_bytes_staged(groups, monkeypatch, dtype):
    xs = tensors(dtype)
    calls = {
        "all_reduce": lambda g: g.all_reduce(xs[g.rank], op="max"),
        "broadcast": lambda g: g.broadcast(xs[g.rank], src=1),
        "all_gather": lambda g: g.all_gather(xs[g.rank]),
        # max, not sum: the hub folds ranks in arrival order, so float sums of two runs may
        # differ in the last bit; max is exact whatever the order.
        "reduce_scatter": lambda g: g.reduce_scatter(
            torch.cat([xs[g.rank]] * WORLD), op="max"),
        "all_to_all": lambda g: g.all_to_all([xs[g.rank][:, :j + 1] for j in range(WORLD)]),
        "all_to_all_single": lambda g: g.all_to_all_single(torch.cat([xs[g.rank]] * WORLD)),
        "all_reduce_coalesced": lambda g: g.all_reduce_coalesced(
            [xs[g.rank], xs[g.rank][0], xs[g.rank][1, 2]], op="max"),
    }
    for name, call in calls.items():
        direct, staged = await both_paths(groups, monkeypatch, call)
        try:
            assert_same(direct, staged)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None


async def test_uneven_all_to_all_single_staged(groups, monkeypatch):
    xs = tensors(torch.float32, (6, 5))
    sends = [[1, 2, 3], [3, 3, 0], [0, 0, 6]]
    receives = [[sends[src][dst] for src in range(WORLD)] for dst in range(WORLD)]
    direct, staged = await both_paths(groups, monkeypatch, lambda g: g.all_to_all_single(
        xs[g.rank], receives[g.rank], sends[g.rank]))
    assert_same(direct, staged)


async def test_a_staged_input_is_copied_when_the_call_is_made(groups, monkeypatch):
    """The host copy is taken at call time: overwriting the tensor before awaiting changes
    nothing (what a CUDA caller relies on to reuse its buffer at once)."""
    monkeypatch.setattr(device, "STAGED_DEVICES", ("cuda", "cpu"))
    xs = [torch.full((1000,), float(r + 1)) for r in range(WORLD)]
    pending = [g.all_reduce(xs[g.rank]) for g in groups]
    for x in xs:
        x.fill_(-100.0)
    results = await asyncio.wait_for(asyncio.gather(*pending), 30)
    for result in results:
        assert torch.equal(result, torch.full((1000,), 6.0))


async def test_send_and_recv_staged(groups, monkeypatch):
    monkeypatch.setattr(device, "STAGED_DEVICES", ("cuda", "cpu"))
    x = torch.arange(300, dtype=torch.bfloat16).reshape(3, 100)
    sent, got = await asyncio.wait_for(asyncio.gather(
        groups[0].send(x, dst=2, tag="t"), groups[2].recv(src=0, tag="t")), 30)
    assert sent is None
    assert got.dtype == torch.bfloat16 and torch.equal(got, x)


async def test_an_averaging_round_staged(groups, monkeypatch):
    params = [torch.full((50,), float(r)) for r in range(WORLD)]
    direct = await each(groups, lambda g: g.sync_global_model(
        params[g.rank], model="m-direct", rule="average"))
    with monkeypatch.context() as patch:
        patch.setattr(device, "STAGED_DEVICES", ("cuda", "cpu"))
        staged = await each(groups, lambda g: g.sync_global_model(
            params[g.rank], model="m-staged", rule="average"))
    assert_same(direct, staged)
    assert torch.equal(staged[0], torch.full((50,), 1.0))


async def test_copies_back_to_the_device_run_off_the_event_loop(groups, monkeypatch):
    """A copy to a GPU blocks until the caller's stream is done: it must never run on the
    loop that drives every collective, peer message and heartbeat."""
    from gradstar.client import convert

    monkeypatch.setattr(device, "STAGED_DEVICES", ("cuda", "cpu"))
    loop_thread = threading.get_ident()
    copied_on = []

    def to_device(host, where, *, stream=None):
        copied_on.append(threading.get_ident())
        return host.clone()

    monkeypatch.setattr(convert, "to_device", to_device)
    x = torch.ones(10)
    await each(groups, lambda g: g.all_reduce(x))
    await each(groups, lambda g: g.all_gather(x))
    await each(groups, lambda g: g.all_to_all([x] * WORLD))
    await each(groups, lambda g: g.all_reduce_coalesced([x, x[:3]]))
    assert len(copied_on) == WORLD * (1 + 1 + WORLD + 2)
    assert loop_thread not in copied_on
