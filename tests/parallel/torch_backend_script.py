"""A torch.distributed rank for tests/parallel/test_torch_backend.py, written the way a user
writes one: only ``backend=`` and ``init_method=`` say which backend carries it.

``python torch_backend_script.py ranks --backend B --init-method URL --rank R --world-size N``
runs every scenario of :data:`SCENARIOS` in one process group and prints one JSON line per
scenario; the test runs it on backend "gloo" and on backend "gradstar" and compares the lines.

``python torch_backend_script.py exits --coordinator HOST:PORT --scratch DIR --runs K`` is the
exit test: it imports torch once, then K times forks a pair of ranks that init, fail a
collective on purpose, train a DDP step and then *exit the interpreter* (atexit handlers,
finalization and all), and prints how each child ended. Forking skips K x 2 torch imports; each
child still ends the way a training script does.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gradstar  # noqa: F401  (registers backend "gradstar")

SCRIPT = Path(__file__)
IN, HIDDEN, OUT = 6, 32, 3  # OUT=3 rows: FSDP2 pads the last layer's shards on 2 and 4 ranks
BATCH = 16  # per step, over all ranks
STEPS = 5
TINY_BUCKET_MB = 2000 / (1 << 20)  # a few KB: DDP splits the MLP into several buckets

# torch 2.13 renamed the *_tensor collectives; the old names are what most scripts still call.
warnings.filterwarnings("ignore", category=FutureWarning)


def make_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1009 * step + 1)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def train(model: nn.Module, rank: int, world: int, steps: int = STEPS) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()


def emit(report: dict) -> None:
    """One JSON line in one write: forked ranks share a pipe, and with PYTHONUNBUFFERED print()
    writes the line and its newline separately, so two ranks' lines could interleave."""
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()


def params_of(module: nn.Module) -> dict[str, list[float]]:
    out = {}
    for name, p in module.named_parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2's DTensor shards
        out[name] = p.detach().double().reshape(-1).tolist()
    return out


# -- scenarios: every rank runs them in this order ---------------------------------------------


def ddp(rank: int, world: int) -> dict:
    """torch's DDP; ranks start from different inits, so DDP's broadcast must align them."""
    model = nn.parallel.DistributedDataParallel(make_mlp(rank), bucket_cap_mb=TINY_BUCKET_MB)
    train(model, rank, world)
    return {"params": params_of(model.module)}


def bf16_hook(state, bucket):
    """torch's own bf16_compress_hook under another name: DDP refuses hooks *named*
    bf16_compress_hook unless CUDA and NCCL are present, though the hook is plain torch code."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return bf16_compress_hook(state, bucket)


def ddp_bf16_hook(rank: int, world: int) -> dict:
    model = nn.parallel.DistributedDataParallel(make_mlp(rank), bucket_cap_mb=TINY_BUCKET_MB)
    model.register_comm_hook(None, bf16_hook)
    train(model, rank, world)
    return {"params": params_of(model.module)}


WIRE_STEPS = 30  # rounding without error feedback builds up over the steps


def ddp_wire_hook(rank: int, world: int, wire: str = "int8", error_feedback: bool = True,
                  steps: int = WIRE_STEPS) -> dict:
    """torch's DDP with gradstar's compressed-gradients hook (buckets in ``wire``)."""
    from gradstar.client.torch_backend import WireHookState, wire_compress_hook

    model = nn.parallel.DistributedDataParallel(make_mlp(rank), bucket_cap_mb=TINY_BUCKET_MB)
    state = WireHookState(wire, error_feedback=error_feedback)
    model.register_comm_hook(state, wire_compress_hook)
    train(model, rank, world, steps)
    return {"params": params_of(model.module),
            "residuals": sorted(r.numel() for r in (state.feedback.residuals.values()
                                                    if state.feedback else []))}


def ddp_quorum_hook(rank: int, world: int) -> dict:
    """torch's DDP with gradstar's Quorum hook (min_ranks = world - 1); the last rank is slow
    (it sleeps before each backward), so its buckets come late and are dropped."""
    from gradstar.client.torch_backend import QuorumHookState, quorum_hook

    model = nn.parallel.DistributedDataParallel(make_mlp(rank), bucket_cap_mb=TINY_BUCKET_MB)
    state = QuorumHookState(min_ranks=world - 1, timeout=0.0)
    model.register_comm_hook(state, quorum_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(QUORUM_STEPS):
        x, y = batch(step)
        opt.zero_grad()
        if rank == world - 1:
            time.sleep(0.15)
        nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
    state.close()
    return {"params": params_of(model.module), "dropped": state.dropped, "sent": state.sent}


QUORUM_STEPS = 6


def ddp_wire_hook_no_ef(rank: int, world: int) -> dict:
    return ddp_wire_hook(rank, world, error_feedback=False)


def ddp_wire_hook_mismatch(rank: int, world: int) -> dict:
    """Rank 0 hooks int8, the others bf16: a named mismatch on every rank, no hang."""
    try:
        ddp_wire_hook(rank, world, wire="int8" if rank == 0 else "bf16", steps=1)
    except Exception as error:
        return {"error": type(error).__name__, "message": str(error)}
    return {"error": None}


def fsdp2(rank: int, world: int) -> dict:
    """FSDP2: every Linear is its own shard group, then the root (same init everywhere: unlike
    DDP, fully_shard does not broadcast)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # A CPU mesh, named: without one, fully_shard picks "cuda" whenever a GPU is present, and
    # this test trains CPU tensors.
    mesh = init_device_mesh("cpu", (world,))
    model = make_mlp(0)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train(model, rank, world)
    local = {name: list(p.to_local().shape) for name, p in model.named_parameters()}
    return {"params": params_of(model), "local_shapes": local}


def collectives(rank: int, world: int) -> dict:
    """Each collective on small integers, so every backend's result is exact."""
    out: dict = {}
    for name in ("SUM", "AVG", "MIN", "MAX", "PRODUCT"):
        t = torch.arange(4.0) + rank + 1
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
        out[f"all_reduce_{name}"] = t.tolist()
    for dtype in (torch.float64, torch.int64, torch.int32, torch.bfloat16, torch.float16,
                  torch.uint8):
        t = (torch.arange(3) * (rank + 1)).to(dtype)
        dist.all_reduce(t)
        out[f"all_reduce_{dtype}"] = [str(t.dtype), t.double().tolist()]
    t = torch.full((2, 3), float(rank))[:, 1]  # a non-contiguous view: written in place
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["all_reduce_view"] = t.tolist()

    gathered = torch.empty(world * 2, 3)
    dist.all_gather_into_tensor(gathered, torch.full((2, 3), float(rank)) + torch.arange(3.0))
    out["all_gather_into_tensor"] = gathered.tolist()
    parts = [torch.empty(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(parts, torch.tensor([rank, 10 * rank]))
    out["all_gather"] = [p.tolist() for p in parts]
    for name in ("SUM", "AVG"):
        shard = torch.empty(2, 3)
        dist.reduce_scatter_tensor(shard, torch.arange(world * 6.0).reshape(world * 2, 3) + rank,
                                   op=getattr(dist.ReduceOp, name))
        out[f"reduce_scatter_tensor_{name}"] = shard.tolist()
    shard = torch.empty(3)
    dist.reduce_scatter(shard, [torch.full((3,), float(rank * world + i)) for i in range(world)])
    out["reduce_scatter"] = shard.tolist()

    t = torch.full((3,), float(rank))
    dist.broadcast(t, src=world - 1)
    out["broadcast"] = t.tolist()
    t = torch.tensor([rank, rank], dtype=torch.int64)
    dist.broadcast(t, src=0)
    out["broadcast_int64"] = t.tolist()
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank, "name": f"r{rank}"})  # uint8 tensors inside
    out["all_gather_object"] = objects
    box = [{"from": rank}]
    dist.broadcast_object_list(box, src=1)
    out["broadcast_object_list"] = box

    t = torch.full((2,), float(rank + 1))
    dist.reduce(t, dst=0)
    if rank == 0:
        out["reduce_on_root"] = t.tolist()
    into = [torch.empty(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), gather_list=into, dst=0)
    if rank == 0:
        out["gather_on_root"] = [x.tolist() for x in into]
    mine = torch.empty(2)
    dist.scatter(mine, [torch.full((2,), 10.0 * i) for i in range(world)] if rank == 1 else None,
                 src=1)
    out["scatter"] = mine.tolist()

    work = dist.all_reduce(torch.ones(3) * rank, async_op=True)
    value = work.get_future().wait()
    work.wait()
    out["async_future_value"] = [v.tolist() for v in value]
    dist.barrier()

    # Subgroups: every rank calls new_group in the same order, members or not.
    groups = {"pair": [0, 1], "odd": list(range(1, world, 2)), "all": list(range(world))}
    for name, ranks in groups.items():
        group = dist.new_group(ranks)
        if rank in ranks:
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t, group=group)
            g = torch.empty(len(ranks))
            dist.all_gather_into_tensor(g, torch.tensor([float(rank)]), group=group)
            b = torch.tensor([float(rank)])
            dist.broadcast(b, src=ranks[-1], group=group)
            dist.barrier(group=group)
            out[f"new_group_{name}"] = {"rank": dist.get_rank(group), "size":
                                        dist.get_world_size(group), "sum": t.tolist(),
                                        "gathered": g.tolist(), "broadcast": b.tolist()}
        else:
            out[f"new_group_{name}"] = None
    return out


def p2p(rank: int, world: int) -> dict:
    """A ring of isend/irecv pairs, then blocking send/recv between ranks 0 and 1."""
    got = torch.empty(3)
    send = dist.isend(torch.full((3,), float(rank)), dst=(rank + 1) % world)
    recv = dist.irecv(got, src=(rank - 1) % world)
    send.wait()
    recv.wait()
    out = {"ring": got.tolist()}
    if rank == 0:
        dist.send(torch.arange(4, dtype=torch.int64), dst=1)
    elif rank == 1:
        t = torch.empty(4, dtype=torch.int64)
        dist.recv(t, src=0)
        out["pair"] = t.tolist()
    return out


def errors(rank: int, world: int) -> dict:
    """A failed collective is a Python exception on every rank, and the next one works."""
    out: dict = {}
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(rank + 1))  # every rank a different shape
    except Exception as error:
        out["mismatch"] = [type(error).__name__, str(error)]
    out["mismatch_seconds"] = time.monotonic() - started
    work = dist.all_reduce(torch.ones(rank + 1), async_op=True)
    try:
        work.get_future().wait()
    except Exception as error:
        out["future_error"] = type(error).__name__
    try:
        work.wait()
    except Exception as error:
        out["wait_error"] = type(error).__name__
    try:
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))
    except Exception as error:
        out["premul_sum"] = [type(error).__name__, str(error)]
    # A device gradstar does not move: refused, named, before any collective starts.
    try:
        dist.all_gather_into_tensor(torch.empty(2 * world, device="meta"), torch.ones(2))
        out["meta"] = None
    except Exception as error:
        out["meta"] = [type(error).__name__, str(error)]
    # DDP with a comm hook on rank 0 only: bf16 buckets there, float32 elsewhere. The failure
    # must come out of backward() as an exception (it once came out as a SIGSEGV).
    model = nn.parallel.DistributedDataParallel(make_mlp(0))
    if rank == 0:
        model.register_comm_hook(None, bf16_hook)
    x, y = batch(0)
    try:
        nn.functional.mse_loss(model(x), y).backward()
        out["ddp_error"] = None
    except Exception as error:
        out["ddp_error"] = [type(error).__name__, str(error)]
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)
    out["after"] = t.tolist()
    return out


def parity(rank: int, world: int) -> dict:
    """Calls from torch's own distributed tests that gloo passes: all_gather_coalesced's lists by
    rank, and the bitwise reduce ops on integer and bool tensors."""
    out: dict = {}
    inputs = [torch.full((2, 2), float(rank)), torch.arange(3.0) + 10 * rank]
    lists = [[torch.empty(2, 2), torch.empty(3)] for _ in range(world)]
    dist.all_gather_coalesced(lists, inputs)
    out["all_gather_coalesced"] = [[t.tolist() for t in ts] for ts in lists]
    lists = [[torch.empty(1, dtype=torch.int64)] for _ in range(world)]
    dist.all_gather_coalesced(lists, [torch.tensor([rank])], async_op=True).wait()
    out["all_gather_coalesced_async"] = [[t.tolist() for t in ts] for ts in lists]
    # Sparse SUM: entries that overlap between ranks and entries only one rank has, with
    # different entry counts per rank (rank r has r + 2 of them).
    coords = [[i % 4 for i in range(rank + 2)], [(i * (rank + 1)) % 5 for i in range(rank + 2)]]
    sparse = torch.sparse_coo_tensor(coords, torch.arange(rank + 2.0) + rank, (4, 5))
    dist.all_reduce(sparse)
    out["sparse_sum"] = [sparse.layout == torch.sparse_coo, sparse.to_dense().tolist()]

    for dtype in (torch.int64, torch.int32, torch.uint8, torch.bool):
        for op in ("BAND", "BOR", "BXOR"):
            t = (torch.tensor([True, rank % 2 == 1, rank == 0, False]) if dtype == torch.bool
                 else ((torch.tensor([12, 10, 7, 255]) >> rank) | (1 << rank)).to(dtype))
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            out[f"all_reduce_{op}_{dtype}"] = [str(t.dtype), t.tolist()]
    t = torch.tensor([1 << rank, 3], dtype=torch.int64)
    dist.reduce(t, dst=world - 1, op=dist.ReduceOp.BOR)
    if rank == world - 1:  # elsewhere torch leaves the tensor undefined (gloo: the result)
        out["reduce_BOR_on_root"] = t.tolist()
    shard = torch.empty(2, dtype=torch.int64)
    dist.reduce_scatter_tensor(shard, torch.arange(2 * world, dtype=torch.int64) << rank,
                               op=dist.ReduceOp.BXOR)
    out["reduce_scatter_tensor_BXOR"] = shard.tolist()
    return out


def parity_errors(rank: int, world: int) -> dict:
    """What gradstar refuses or times out, each with a message naming what went wrong."""
    out: dict = {}
    for name, call in [
        ("band_float", lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)),
        ("sparse", lambda: dist.all_reduce(torch.eye(3).to_sparse(), op=dist.ReduceOp.MAX)),
    ]:
        try:
            call()
            out[name] = None
        except Exception as error:
            out[name] = [type(error).__name__, str(error)]
    # A 1 s timeout that only rank 0 waits out: the others arrive late and get the same verdict.
    # Together first (the default group's timeout): else a rank 0 that reached this point over
    # a second after the others would meet them here, and nothing would time out.
    dist.barrier()
    opts = dist.AllreduceOptions()
    opts.timeout = timedelta(seconds=1)
    if rank != 0:
        time.sleep(2)
    try:
        dist.group.WORLD.allreduce([torch.ones(2)], opts).wait()
        out["timeout"] = None
    except Exception as error:
        out["timeout"] = [type(error).__name__, str(error)]
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)
    out["after"] = t.tolist()
    return out


def all_to_all(rank: int, world: int) -> dict:
    """all_to_all_single with uneven (and empty) splits, equal splits of rows of a dtype
    gradstar moves as bytes (3-byte rows), complex and bool tensors, async_op; all_to_all's list
    form with tensors of other shapes on each rank."""
    out: dict = {}
    sends = [[(s * 2 + d) % 3 for d in range(world)] for s in range(world)]  # uneven, some 0
    x = torch.arange(sum(sends[rank]) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * rank
    expects = [sends[s][rank] for s in range(world)]
    got = torch.empty(sum(expects), 2)
    dist.all_to_all_single(got, x, expects, sends[rank])
    out["single_uneven"] = got.tolist()
    for dtype in (torch.uint8, torch.int8, torch.bool, torch.complex64, torch.bfloat16):
        x = (torch.arange(world * 2 * 3) * (rank + 1)).reshape(world * 2, 3)
        x = x % 2 == 1 if dtype == torch.bool else (x + 1j * rank if dtype == torch.complex64
                                                    else x).to(dtype)
        got = torch.empty_like(x)
        dist.all_to_all_single(got, x, async_op=True).wait()
        out[f"single_{dtype}"] = [str(got.dtype), torch.view_as_real(got).tolist()
                                  if got.is_complex() else got.float().tolist()]
    inputs = [torch.full((2, 2), float(10 * rank + d)) for d in range(world)]
    outputs = [torch.empty(2, 2) for _ in range(world)]  # gloo: one shape throughout
    dist.all_to_all(outputs, inputs)
    out["list"] = [t.tolist() for t in outputs]
    inputs = [torch.tensor([rank, d], dtype=torch.uint8) for d in range(world)]
    outputs = [torch.empty(2, dtype=torch.uint8) for _ in range(world)]
    dist.all_to_all(outputs, inputs, async_op=True).wait()
    out["list_uint8"] = [t.tolist() for t in outputs]
    return out


def recv_any(rank: int, world: int) -> dict:
    """Every rank but 0 sends rank 0 three tensors, all at once; rank 0 receives them from any
    source (``dist.recv`` returns the sender, as does ``irecv``'s ``_source_rank()``)."""
    if rank != 0:
        works = [dist.isend(torch.tensor([float(rank), float(i)]), dst=0) for i in range(3)]
        for work in works:
            work.wait()
        dist.send(torch.tensor([float(rank), 9.0]), dst=0, tag=7)
        return {}
    got = []
    for _ in range(3 * (world - 1)):
        t = torch.empty(2)
        got.append((dist.recv(t), t.tolist()))
    tagged = []
    for _ in range(world - 1):
        t = torch.empty(2)
        work = dist.irecv(t, tag=7)
        work.wait()
        tagged.append([work._source_rank(), t.tolist()])
    return {"senders_named": all(src == int(t[0]) for src, t in got),
            "by_sender": {str(src): [t[1] for s, t in got if s == src]
                          for src in range(1, world)},
            "tagged": sorted(tagged)}


def all_to_all_errors(rank: int, world: int) -> dict:
    """all_to_all_single whose split sizes disagree between two ranks (the last rank expects a
    row more from rank 0 than rank 0 sends it): every rank raises, and the next call works."""
    out: dict = {}
    expects = [1] * world
    if rank == world - 1:
        expects[0] = 2
    try:
        dist.all_to_all_single(torch.empty(sum(expects)), torch.ones(world), expects, [1] * world)
        out["mismatch"] = None
    except Exception as error:
        out["mismatch"] = [type(error).__name__, str(error)]
    got = torch.empty(world)
    dist.all_to_all_single(got, torch.full((world,), float(rank)))
    out["after"] = got.tolist()
    return out


SCENARIOS = {"ddp": ddp, "ddp_bf16_hook": ddp_bf16_hook, "fsdp2": fsdp2,
             "collectives": collectives, "p2p": p2p, "errors": errors, "parity": parity,
             "parity_errors": parity_errors, "all_to_all": all_to_all, "recv_any": recv_any,
             "all_to_all_errors": all_to_all_errors, "ddp_wire_hook": ddp_wire_hook,
             "ddp_wire_hook_no_ef": ddp_wire_hook_no_ef,
             "ddp_wire_hook_mismatch": ddp_wire_hook_mismatch,
             "ddp_quorum_hook": ddp_quorum_hook}


def run_ranks(args) -> int:
    torch.set_num_threads(1)  # the ranks share two cores with the hub
    dist.init_process_group(args.backend, init_method=args.init_method, rank=args.rank,
                            world_size=args.world_size, timeout=timedelta(seconds=120))
    try:
        for name in args.scenarios or list(SCENARIOS):
            try:
                result = SCENARIOS[name](args.rank, args.world_size)
            except Exception as error:
                result = {"fatal": type(error).__name__, "message": str(error)}
            emit({"scenario": name, "rank": args.rank, **result})
            if "fatal" in result:
                return 3
        dist.barrier()  # nobody leaves while a peer is still in its last collective
    finally:
        dist.destroy_process_group()
    return 0


# -- the exit test -----------------------------------------------------------------------------


def exit_child(run: int, rank: int, coordinator: str, scratch: str) -> int:
    """One rank of one run. Variants by run % 4: 0 initializes with a file:// init_method (the
    coordinator and job from GRADSTAR_* env), adds a gloo subgroup and destroys its groups at
    the end; 1 configures
    everything through GRADSTAR_* env and exits with a collective in flight, leaving the group
    to the exit hook; 2 fails a DDP step (rank 0 compresses, rank 1 does not) and destroys; 3
    has rank 1 exit while rank 0 waits in a barrier, which must fail with the lost rank named."""
    variant, job = run % 4, f"exit-{run}"
    torch.set_num_threads(1)
    if variant == 0:
        # Any torch init_method works: torch's store, the coordinator and job from the env.
        os.environ.update(GRADSTAR_COORDINATOR=coordinator, GRADSTAR_JOB=job)
        dist.init_process_group("gradstar", init_method=f"file://{scratch}/{job}", rank=rank,
                                world_size=2, timeout=timedelta(seconds=20))
    elif variant == 1:
        os.environ.update(GRADSTAR_COORDINATOR=coordinator, GRADSTAR_JOB=job,
                          GRADSTAR_RANK=str(rank), GRADSTAR_WORLD_SIZE="2",
                          GRADSTAR_TIMEOUT="20", GRADSTAR_JOIN_TIMEOUT="30")
        dist.init_process_group("gradstar", init_method="gradstar://")
    else:
        dist.init_process_group("gradstar", rank=rank, world_size=2,
                                init_method=f"gradstar://{coordinator}?job={job}&timeout=20"
                                            "&join_timeout=30")
    report: dict = {"run": run, "rank": rank}
    t = torch.ones(2) * (rank + 1)
    dist.all_reduce(t)
    report["sum"] = t.tolist()
    try:
        dist.all_reduce(torch.ones(rank + 2))
    except Exception as error:
        report["mismatch"] = type(error).__name__
    model = nn.parallel.DistributedDataParallel(make_mlp(0))
    if variant == 2 and rank == 0:
        model.register_comm_hook(None, bf16_hook)
    x, y = batch(run)
    try:
        nn.functional.mse_loss(model(x), y).backward()
        report["ddp"] = "ok"
    except Exception as error:
        report["ddp"] = type(error).__name__
    if variant == 3:
        if rank == 0:
            try:
                dist.barrier()
                report["barrier"] = "completed"
            except Exception as error:
                report["barrier"] = [type(error).__name__, str(error)]
        emit(report)
        return 0  # no destroy: rank 1's exit hook leaves the job while rank 0 waits
    t = torch.ones(2) * (rank + 1)
    dist.all_reduce(t)
    report["after"] = t.tolist()
    if variant == 0:
        # torch's file store is shared, so a gloo subgroup next to gradstar's groups works.
        t = torch.ones(2) * (rank + 1)
        dist.all_reduce(t, group=dist.new_group(backend="gloo"))
        report["gloo_subgroup"] = t.tolist()
    if variant in (0, 2):
        dist.destroy_process_group()
    else:
        # Leave with 16 MB still on the wire: the exit hook must shut gradstar down while its
        # loop thread is busy, and whatever state that collective is in, exit cleanly.
        dist.all_reduce(torch.ones(4 << 20), async_op=True)
    emit(report)
    return 0


def fork_child(run: int, rank: int, coordinator: str, scratch: str) -> int:
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        # The child leaves through SystemExit like any script: atexit handlers and interpreter
        # finalization run. Nothing of the parent's below this frame may run here.
        code = 1
        try:
            code = exit_child(run, rank, coordinator, scratch)
        except BaseException as error:
            emit({"run": run, "rank": rank, "fatal": repr(error)})
        raise SystemExit(code)
    return pid


def wait_children(pids: list[int], timeout: float) -> list:
    """Each child's exit: ["exit", code], ["signal", number] or ["hung", None] (then killed)."""
    deadline = time.monotonic() + timeout
    ends: dict[int, list] = {}
    while len(ends) < len(pids):
        for pid in pids:
            if pid in ends:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                ends[pid] = (["signal", os.WTERMSIG(status)] if os.WIFSIGNALED(status)
                             else ["exit", os.WEXITSTATUS(status)])
        if len(ends) < len(pids):
            if time.monotonic() > deadline:
                for pid in pids:
                    if pid not in ends:
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                        ends[pid] = ["hung", None]
                break
            time.sleep(0.02)
    return [ends[pid] for pid in pids]


def run_exits(args) -> int:
    # What DDP would import lazily in every child (torch._dynamo: seconds), imported once here.
    import torch._dynamo  # noqa: F401
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: F401

    # Python's advice for forking servers: the children's garbage collector (and the last
    # collection at exit) skips the objects imported here, instead of touching them all (a
    # second of CPU per child). Everything a child creates is still collected and finalized.
    gc.freeze()
    for run in range(args.runs):
        started = time.monotonic()
        pids = [fork_child(run, rank, args.coordinator, args.scratch) for rank in range(2)]
        ends = wait_children(pids, args.timeout)
        emit({"run": run, "ends": ends, "seconds": time.monotonic() - started})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    ranks = sub.add_parser("ranks")
    ranks.add_argument("--backend", required=True)
    ranks.add_argument("--init-method", required=True)
    ranks.add_argument("--rank", type=int, required=True)
    ranks.add_argument("--world-size", type=int, required=True)
    ranks.add_argument("scenarios", nargs="*")
    exits = sub.add_parser("exits")
    exits.add_argument("--coordinator", required=True)
    exits.add_argument("--scratch", required=True, help="a folder for file:// rendezvous")
    exits.add_argument("--runs", type=int, default=20)
    exits.add_argument("--timeout", type=float, default=60)
    args = parser.parse_args(argv)
    return run_ranks(args) if args.mode == "ranks" else run_exits(args)


if __name__ == "__main__":
    raise SystemExit(main())
