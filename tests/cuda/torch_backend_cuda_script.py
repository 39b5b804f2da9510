"""One rank of a torch.distributed program over backend "gradstar" whose tensors all live on one
device, for tests/cuda/test_torch_backend_cuda.py (``--device cuda``: every rank on cuda:0, which
the ranks share) and tests/parallel/test_torch_backend_staged.py (``--device cpu --stage-cpu``:
CPU tensors staged through host copies exactly as CUDA tensors are, see
:mod:`gradstar.client.device`).

``python torch_backend_cuda_script.py --device D [--stage-cpu] [SCENARIO ...]`` runs every
scenario of :data:`SCENARIOS` (or those named) in one process group and prints one JSON line per
scenario. The coordinator, job, rank and world size come from the ``GRADSTAR_*`` environment.

Every rank's inputs are functions of its rank, so each rank computes, without communicating,
what every collective must give; a check reports the result next to that reference (see
:class:`Checks`). Training reports the parameters next to those of the same model trained by one
process on the whole batch, on the same device.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gradstar  # noqa: F401  (registers backend "gradstar")
from gradstar.client import device as staging

if not __package__:  # run as a file, the way the tests start ranks: find the `tests` package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.parallel.torch_backend_script import emit, params_of

SCRIPT = Path(__file__)
IN, HIDDEN, OUT = 6, 32, 3  # OUT=3 rows: FSDP2 pads the last layer's shards on 2 ranks
BATCH = 16  # per step, over all ranks
STEPS = 5
TINY_BUCKET_MB = 2000 / (1 << 20)  # a few KB: DDP splits the MLP into several buckets
LARGE = 1 << 20  # elements of the tensors that race a busy stream (4 MB: many wire chunks)
SMALL = 6  # ... and of the small ones (one message each way: the direct lane)
BUSY_CYCLES = 50_000_000  # torch.cuda._sleep: keeps a stream busy for tens of milliseconds
BITWISE = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}

# torch 2.13 renamed the *_tensor collectives; the old names are what most scripts still call.
warnings.filterwarnings("ignore", category=FutureWarning)


class Checks:
    """Results of collectives next to the references computed here, by check name: each entry
    holds the result's values, the reference's values, the result's device, both dtypes and the
    result's layout. Values are plain floats (complex tensors as (real, imaginary) pairs, sparse
    ones dense) so that JSON carries them exactly."""

    def __init__(self) -> None:
        self.found: dict[str, dict] = {}

    def add(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        self.found[name] = {"got": values(got), "want": values(want), "device": str(got.device),
                            "dtypes": [str(got.dtype), str(want.dtype)],
                            "layout": str(got.layout)}


def values(t: torch.Tensor) -> list:
    t = t.detach().cpu()
    if t.layout == torch.sparse_coo:
        t = t.to_dense()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.to(torch.float64).tolist()


def ramp(rank: int, n: int = 6, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank ``rank``'s input: ``n`` small integers, exact in every dtype used here."""
    t = torch.arange(n) * (rank + 1) + rank
    if dtype == torch.bool:
        return t % 3 == 0
    if dtype.is_complex:
        return t.to(dtype) * (1 - 2j)
    return t.to(dtype)


def bits(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input of a bitwise reduction."""
    if dtype == torch.bool:
        return torch.tensor([True, rank % 2 == 1, rank == 0, False])
    return ((torch.tensor([12, 10, 7, 255]) >> rank) | (1 << rank)).to(dtype)


def uneven_rows(source: int, world: int) -> tuple[torch.Tensor, list[int]]:
    """Rank ``source``'s all_to_all_single input of rows of 2, and its input_split_sizes:
    uneven, some empty."""
    sends = [(source * 2 + d) % 3 for d in range(world)]
    rows = (torch.arange(sum(sends) * 2, dtype=torch.float32) + 100 * source).reshape(-1, 2)
    return rows, sends


def split_for(source: int, rank: int, world: int) -> torch.Tensor:
    """The rows rank ``source`` sends rank ``rank`` in the uneven all_to_all_single."""
    rows, sends = uneven_rows(source, world)
    start = sum(sends[:rank])
    return rows[start:start + sends[rank]]


# -- scenarios: every rank runs them in this order ---------------------------------------------


def collectives(rank: int, world: int, device: torch.device) -> dict:
    """Every collective the backend implements, on tensors on ``device``, written in place."""
    checks = Checks()
    everyone = torch.stack([ramp(r) for r in range(world)])
    for name, want in (("SUM", everyone.sum(0)), ("AVG", everyone.mean(0)),
                       ("MIN", everyone.amin(0)), ("MAX", everyone.amax(0)),
                       ("PRODUCT", everyone.prod(0))):
        t = ramp(rank).to(device)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
        checks.add(f"all_reduce_{name}", t, want)
    for dtype in (torch.float64, torch.int64, torch.int32, torch.bfloat16, torch.float16,
                  torch.uint8, torch.int8, torch.bool, torch.complex64):
        t = ramp(rank, dtype=dtype).to(device)
        dist.all_reduce(t)
        want = torch.stack([ramp(r, dtype=dtype) for r in range(world)]).sum(0).to(dtype)
        checks.add(f"all_reduce_{dtype}", t, want)
    base = torch.zeros(2, 3, device=device)
    base[:, 1] = rank
    dist.all_reduce(base[:, 1], op=dist.ReduceOp.MAX)  # a non-contiguous view, in place
    want = torch.zeros(2, 3)
    want[:, 1] = world - 1
    checks.add("all_reduce_view", base, want)
    for dtype in (torch.int64, torch.uint8, torch.bool):
        for name, reduce in BITWISE.items():
            t = bits(rank, dtype).to(device)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
            checks.add(f"all_reduce_{name}_{dtype}", t,
                       functools.reduce(reduce, [bits(r, dtype) for r in range(world)]))
    coords = [[[i % 4 for i in range(r + 2)], [(i * (r + 1)) % 5 for i in range(r + 2)]]
              for r in range(world)]
    sparse = [torch.sparse_coo_tensor(coords[r], torch.arange(r + 2.0) + r, (4, 5))
              for r in range(world)]
    want = sum(s.to_dense() for s in sparse)
    t = sparse[rank].to(device)  # the same tensor where the device is the CPU
    dist.all_reduce(t)
    checks.add("all_reduce_sparse", t, want)

    for dtype, src in ((torch.float32, world - 1), (torch.int64, 0), (torch.bfloat16, 1),
                       (torch.int8, 0)):
        t = ramp(rank, dtype=dtype).to(device)
        dist.broadcast(t, src=src)
        checks.add(f"broadcast_{dtype}", t, ramp(src, dtype=dtype))

    for dtype in (torch.float32, torch.int64, torch.uint8):
        parts = [torch.empty(6, dtype=dtype, device=device) for _ in range(world)]
        dist.all_gather(parts, ramp(rank, dtype=dtype).to(device))
        checks.add(f"all_gather_{dtype}", torch.stack(parts),
                   torch.stack([ramp(r, dtype=dtype) for r in range(world)]))
    out = torch.empty(world * 6, device=device)
    dist.all_gather_into_tensor(out, ramp(rank).to(device))
    checks.add("all_gather_into_tensor", out, everyone.reshape(-1))
    lists = [[torch.empty(6, device=device), torch.empty(2, device=device)]
             for _ in range(world)]
    dist.all_gather_coalesced(lists, [ramp(rank).to(device),
                                      torch.tensor([rank, 10.0 * rank], device=device)])
    checks.add("all_gather_coalesced", torch.stack([ts[0] for ts in lists]), everyone)
    checks.add("all_gather_coalesced_second", torch.stack([ts[1] for ts in lists]),
               torch.tensor([[r, 10.0 * r] for r in range(world)]))

    wholes = torch.stack([ramp(r, n=world * 3) for r in range(world)])
    for name, total in (("SUM", wholes.sum(0)), ("AVG", wholes.mean(0))):
        shard = torch.empty(3, device=device)
        dist.reduce_scatter_tensor(shard, ramp(rank, n=world * 3).to(device),
                                   op=getattr(dist.ReduceOp, name))
        checks.add(f"reduce_scatter_tensor_{name}", shard, total[3 * rank:3 * rank + 3])
    shard = torch.empty(3, device=device)
    dist.reduce_scatter(shard, list(ramp(rank, n=world * 3).to(device).chunk(world)))
    checks.add("reduce_scatter", shard, wholes.sum(0)[3 * rank:3 * rank + 3])

    t = ramp(rank).to(device)
    dist.reduce(t, dst=0)
    if rank == 0:
        checks.add("reduce_on_root", t, everyone.sum(0))
    into = [torch.empty(6, device=device) for _ in range(world)] if rank == 0 else None
    dist.gather(ramp(rank).to(device), gather_list=into, dst=0)
    if rank == 0:
        checks.add("gather_on_root", torch.stack(into), everyone)
    mine = torch.empty(6, device=device)
    dist.scatter(mine, [ramp(10 + i).to(device) for i in range(world)]
                 if rank == world - 1 else None, src=world - 1)
    checks.add("scatter", mine, ramp(10 + rank))

    rows, sends = uneven_rows(rank, world)
    expects = [uneven_rows(s, world)[1][rank] for s in range(world)]
    got = torch.empty(sum(expects), 2, device=device)
    dist.all_to_all_single(got, rows.to(device), expects, sends)
    checks.add("all_to_all_single_uneven", got,
               torch.cat([split_for(s, rank, world) for s in range(world)]))
    for dtype in (torch.float32, torch.int8, torch.complex64):
        x = ramp(rank, n=world * 2 * 3, dtype=dtype).reshape(world * 2, 3)
        got = torch.empty_like(x, device=device)
        dist.all_to_all_single(got, x.to(device), async_op=True).wait()
        checks.add(f"all_to_all_single_{dtype}", got, torch.cat(
            [ramp(s, n=world * 2 * 3, dtype=dtype).reshape(world * 2, 3)[2 * rank:2 * rank + 2]
             for s in range(world)]))
    outputs = [torch.empty(2, 2, device=device) for _ in range(world)]
    dist.all_to_all(outputs, [torch.full((2, 2), 10.0 * rank + d, device=device)
                              for d in range(world)])
    checks.add("all_to_all", torch.stack(outputs),
               torch.stack([torch.full((2, 2), 10.0 * s + rank) for s in range(world)]))

    t = ramp(rank).to(device)
    doubled = dist.all_reduce(t, async_op=True).get_future().then(
        lambda fut: fut.value()[0] * 2).wait()
    checks.add("all_reduce_future_then", doubled, everyone.sum(0) * 2)
    dist.barrier()
    return {"checks": checks.found, "staged": staging.is_staged(t)}


def streams(rank: int, world: int, device: torch.device) -> dict:
    """torch's stream rules, on a CUDA device (on the CPU the same calls, without streams).

    A collective issued on a side stream whose tensors are produced (or overwritten) behind a
    busy kernel there sees that work; its results are complete, for every stream, when it
    returns (read below on the default stream without waiting for the side one); and a
    future's value read on a side stream is ready there."""
    checks = Checks()
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    # Both sizes: a small waited collective runs on the caller's thread over the direct lane,
    # a large one on the group's loop (both settle on the caller's thread, on its streams).
    for size, name in ((LARGE, ""), (SMALL, "small_")):
        with on_stream(side):
            busy(device)
            t = torch.full((size,), float(rank + 1), device=device)
            dist.all_reduce(t)
        checks.add(f"{name}input_behind_busy_stream", extremes(t),
                   torch.tensor([float(sum(range(1, world + 1)))] * 2))

    with on_stream(side):
        got = torch.empty(LARGE, device=device)
        busy(device)
        got.fill_(-1.0)  # queued before the recv: must not land after the message
        if rank == 0:
            dist.send(torch.full((LARGE,), 7.0, device=device), dst=1)
        elif rank == 1:
            dist.recv(got, src=0)
    if rank == 1:
        checks.add("recv_behind_busy_stream", extremes(got), torch.tensor([7.0, 7.0]))

    for size, name in ((LARGE, ""), (SMALL, "small_")):
        with on_stream(side):
            out = torch.empty(world * size, device=device)
            busy(device)
            out.fill_(-1.0)  # queued before the call: must not land after the results
            dist.all_gather_into_tensor(out, torch.full((size,), float(rank), device=device))
        checks.add(f"{name}output_behind_busy_stream",
                   torch.stack([extremes(part) for part in out.chunk(world)]),
                   torch.tensor([[float(r)] * 2 for r in range(world)]))

    t = torch.full((LARGE,), float(rank + 1), device=device)
    future = dist.all_reduce(t, async_op=True).get_future()
    with on_stream(side):
        doubled = future.wait()[0] * 2
    if side is not None:
        torch.cuda.current_stream(device).wait_stream(side)  # doubled was made there
    checks.add("future_on_side_stream", extremes(doubled),
               torch.tensor([2.0 * sum(range(1, world + 1))] * 2))
    return {"checks": checks.found}


def on_stream(side: torch.cuda.Stream | None):
    """A context making ``side`` the current stream (none on the CPU)."""
    return contextlib.nullcontext() if side is None else torch.cuda.stream(side)


def busy(device: torch.device) -> None:
    """Keep the current CUDA stream busy for a while (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda._sleep(BUSY_CYCLES)


def extremes(t: torch.Tensor) -> torch.Tensor:
    return torch.stack([t.min(), t.max()])


def p2p(rank: int, world: int, device: torch.device) -> dict:
    """A ring of isend/irecv pairs, then a blocking send/recv of a dtype that travels as bytes."""
    checks = Checks()
    got = torch.empty(6, device=device)
    send = dist.isend(ramp(rank).to(device), dst=(rank + 1) % world)
    recv = dist.irecv(got, src=(rank - 1) % world)
    send.wait()
    recv.wait()
    checks.add("ring", got, ramp((rank - 1) % world))
    if rank == 0:
        dist.send(ramp(0, dtype=torch.int8).to(device), dst=1)
    elif rank == 1:
        t = torch.empty(6, dtype=torch.int8, device=device)
        dist.recv(t, src=0)
        checks.add("pair_int8", t, ramp(0, dtype=torch.int8))
    return {"checks": checks.found}


# -- training ----------------------------------------------------------------------------------


def make_mlp(seed: int, device: torch.device) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT)).to(device)


def train(model: nn.Module, rank: int, world: int, device: torch.device) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1009 * step + 1)
        x, y = torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.chunk(world)[rank].to(device)),
                               y.chunk(world)[rank].to(device)).backward()
        opt.step()


def one_process(device: torch.device) -> dict[str, list[float]]:
    """The parameters of the model trained by one process on every step's whole batch."""
    model = make_mlp(0, device)
    train(model, 0, 1, device)
    return params_of(model)


def bf16_hook(state, bucket):
    """torch's own bf16_compress_hook under another name: DDP refuses hooks *named*
    bf16_compress_hook unless NCCL is present, though the hook is plain torch code. Its
    ``.then()`` callback copies the result into the bucket on a stream of its own."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return bf16_compress_hook(state, bucket)


def ddp_model(rank: int, device: torch.device) -> nn.parallel.DistributedDataParallel:
    """torch's DDP from different inits per rank (DDP's broadcast must align them)."""
    device_ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(make_mlp(rank, device), device_ids=device_ids,
                                               bucket_cap_mb=TINY_BUCKET_MB)


def ddp(rank: int, world: int, device: torch.device) -> dict:
    model = ddp_model(rank, device)
    train(model, rank, world, device)
    return {"params": params_of(model.module), "reference": one_process(device),
            "devices": sorted({str(p.device) for p in model.parameters()})}


def ddp_bf16_hook(rank: int, world: int, device: torch.device) -> dict:
    model = ddp_model(rank, device)
    model.register_comm_hook(None, bf16_hook)
    train(model, rank, world, device)
    return {"params": params_of(model.module), "reference": one_process(device)}


def fsdp2(rank: int, world: int, device: torch.device) -> dict:
    """FSDP2 on a mesh of ``device``'s type: every Linear its own shard group, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    model = make_mlp(0, device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train(model, rank, world, device)
    shards = {name: p.to_local() for name, p in model.named_parameters()}
    return {"params": params_of(model), "reference": one_process(device),
            "local_shapes": {name: list(s.shape) for name, s in shards.items()},
            "devices": sorted({str(s.device) for s in shards.values()})}


SCENARIOS = {"collectives": collectives, "streams": streams, "p2p": p2p, "ddp": ddp,
             "ddp_bf16_hook": ddp_bf16_hook, "fsdp2": fsdp2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--stage-cpu", action="store_true",
                        help="stage CPU tensors through host copies as CUDA tensors are")
    parser.add_argument("scenarios", nargs="*", help=f"some of {', '.join(SCENARIOS)}")
    args = parser.parse_args(argv)
    if args.stage_cpu:
        staging.STAGED_DEVICES = ("cuda", "cpu")
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", 0)  # every rank on the first GPU: they share it
        torch.cuda.set_device(device)
    torch.set_num_threads(1)  # the ranks share the machine's cores with the hub
    torch.set_float32_matmul_precision("highest")  # no TF32: compared in float32 tolerance
    dist.init_process_group("gradstar", init_method="gradstar://",
                            timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        for name in args.scenarios or list(SCENARIOS):
            try:
                result = SCENARIOS[name](rank, world, device)
            except Exception as error:
                result = {"fatal": type(error).__name__, "message": str(error)}
            emit({"scenario": name, "rank": rank, **result})
            if "fatal" in result:
                return 3
        dist.barrier()  # nobody leaves while a peer is still in its last collective
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
