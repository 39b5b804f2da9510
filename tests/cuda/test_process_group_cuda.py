"""gradstar.ProcessGroup with CUDA tensors: every collective and send/recv gives, on the
tensor's device, the bytes the CPU path gives; stream order holds at both ends. Ranks are
AsyncProcessGroups in one process sharing the GPU, over a real coordinator."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.integration.conftest import close_all, join_all

from .conftest import needs_cuda

pytestmark = needs_cuda

WORLD = 3
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]


@pytest.fixture
async def groups(coordinator):
    gs = await join_all(coordinator.address, WORLD, chunk_bytes=4096)
    yield gs
    await close_all(gs)


def tensors(dtype, shape=(64, 33)):
    gen = torch.Generator().manual_seed(11)
    return [(torch.rand(shape, generator=gen) * 40 - 20).to(dtype) for _ in range(WORLD)]


async def each(groups, call):
    return await asyncio.wait_for(asyncio.gather(*(call(g) for g in groups)), 60)


def assert_same_on(device, got, want):
    if isinstance(want, list | tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same_on(device, g, w)
        return
    assert got.device == device and got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
async def test_every_collective_on_cuda_equals_the_cpu_path(groups, dtype):
    cuda = torch.device("cuda", 0)
    xs = tensors(dtype)
    calls = {
        "all_reduce": lambda g, x: g.all_reduce(x[g.rank], op="max"),
        "broadcast": lambda g, x: g.broadcast(x[g.rank], src=2),
        "all_gather": lambda g, x: g.all_gather(x[g.rank]),
        # max, not sum: the hub folds ranks in arrival order, so float sums of two runs may
        # differ in the last bit; max is exact whatever the order.
        "reduce_scatter": lambda g, x: g.reduce_scatter(torch.cat([x[g.rank]] * WORLD),
                                                        op="max"),
        "all_to_all": lambda g, x: g.all_to_all([x[g.rank][:, :j + 1] for j in range(WORLD)]),
        "all_to_all_single": lambda g, x: g.all_to_all_single(torch.cat([x[g.rank]] * WORLD)),
        "all_reduce_coalesced": lambda g, x: g.all_reduce_coalesced(
            [x[g.rank], x[g.rank][0], x[g.rank][1, 2]], op="max"),  # a 0-d one too
    }
    on_gpu = [x.to(cuda) for x in xs]
    for name, call in calls.items():
        want = await each(groups, lambda g, call=call: call(g, xs))
        got = await each(groups, lambda g, call=call: call(g, on_gpu))
        try:
            assert_same_on(cuda, got, want)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None


async def test_send_and_recv_a_cuda_tensor(groups):
    x = torch.arange(3000, dtype=torch.float32, device="cuda").reshape(30, 100)
    _, got = await asyncio.wait_for(asyncio.gather(
        groups[0].send(x, dst=1, tag="t"), groups[1].recv(src=0, tag="t")), 60)
    # No device travels on the wire: recv returns a CPU tensor; .to(device) puts it back.
    assert got.device.type == "cpu" and torch.equal(got, x.cpu())


async def test_the_input_is_read_after_the_kernels_queued_before_the_call(groups):
    """A tensor still being written on a side stream when the collective is called: the host
    copy waits for that stream (the caller's current one), so the sum sees the final values."""
    side = torch.cuda.Stream()
    pending = []
    for g in groups:
        with torch.cuda.stream(side):
            x = torch.zeros(1 << 22, device="cuda")
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles: the adds run after the call
            for _ in range(20):
                x.add_(1.0)
            pending.append(g.all_reduce(x))
    results = await asyncio.wait_for(asyncio.gather(*pending), 60)
    for result in results:
        assert torch.equal(result.cpu(), torch.full((1 << 22,), 20.0 * WORLD))


async def test_a_result_is_ready_on_another_stream(groups):
    results = await each(groups, lambda g: g.all_reduce(
        torch.full((1 << 20,), float(g.rank), device="cuda")))
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        total = results[0].sum()
    other.synchronize()
    assert total.item() == float(sum(range(WORLD))) * (1 << 20)


async def test_a_sync_group_with_cuda_tensors(coordinator):
    """The blocking API and async_op Work, from threads, with CUDA tensors."""
    import gradstar

    def rank(r):
        with gradstar.init_process_group(coordinator=coordinator.address, job="sync-cuda",
                                         world_size=2, rank=r, timeout=30) as pg:
            x = torch.full((1000,), r + 1.0, device="cuda")
            work = pg.all_reduce(x, async_op=True)
            x.fill_(0)  # the host copy was taken at call time
            summed = work.wait()
            return summed.device.type, summed.cpu().tolist()[:3]

    loop = asyncio.get_running_loop()
    results = await asyncio.wait_for(asyncio.gather(
        *(loop.run_in_executor(None, rank, r) for r in range(2))), 60)
    assert results == [("cuda", [3.0, 3.0, 3.0])] * 2
