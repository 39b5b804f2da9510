"""An FSDP rank for tests: ``python fsdp_script.py OUT_DIR WORLD:SCENARIO,... ...``.

For each ``WORLD:SCENARIO,...`` argument in turn, the ranks below WORLD join job
``$GRADSTAR_JOB-WORLD`` of that world size (the others skip it) and run the scenarios on it,
each on fresh models seeded by the rank (so only the construction broadcast can make the ranks
agree), printing one JSON line per scenario. One launch of 4 processes thus also plays the
2-rank scenarios, without paying for two more processes' torch import. Checkpoint files go to
OUT_DIR; the coordinator address and this process's rank come from GRADSTAR_* env vars.

The models, data, training loop and storage accounting are defined here once and imported by
``test_fsdp.py``, which trains the single-process references with the same code.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import gradstar
from gradstar.client import device
from gradstar.errors import ConfigurationError, GradstarError

try:
    from .scenarios import run_scenario
except ImportError:  # run as a script
    from scenarios import run_scenario

SCRIPT = Path(__file__)
WIDTHS = (5, 9, 13, 17, 3)  # every unit's size is 2 mod 4: padding with 4 ranks
BATCH = 16  # per step over all ranks
STEPS = 5
MEMORY_DEPTH, MEMORY_WIDTH = 16, 125  # 16 units of 15750 elements: each 6.25% of the model


class MLP(nn.Module):
    """Four Linear units and a root-level ``scale`` (the root unit's leftover, 3 elements)."""

    def __init__(self, seed: int, widths=WIDTHS) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2, self.fc3, self.fc4 = (nn.Linear(a, b)
                                                  for a, b in itertools.pairwise(widths))
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(widths[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.fc1(x))
        x = torch.tanh(self.fc2(x))
        x = torch.tanh(self.fc3(x))
        return self.fc4(x) * self.scale


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x)) * self.gain


class NestedNet(nn.Module):
    """Nested units (Block around its Linear), a frozen unit, a weight tied between two units
    (owned by the root, their common enclosing unit) and a buffer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(WIDTHS[0], 7)
        self.frozen = nn.Linear(7, 7).requires_grad_(False)
        self.blocks = nn.Sequential(Block(7), Block(7))
        self.head = nn.Linear(7, 7)
        self.out = nn.Linear(7, 7)
        self.out.weight = self.head.weight
        self.register_buffer("offset", torch.full((7,), float(seed)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.frozen(torch.tanh(self.embed(x)))
        x = torch.tanh(self.head(self.blocks(x)))
        return self.out(x)[:, :WIDTHS[-1]] + self.offset[:WIDTHS[-1]]


NESTED_POLICY = [Block, nn.Linear]


def memory_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers = []
    for _ in range(MEMORY_DEPTH):
        layers += [nn.Linear(MEMORY_WIDTH, MEMORY_WIDTH), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def batch(step: int, width: int = WIDTHS[0], out: int = WIDTHS[-1]):
    g = torch.Generator().manual_seed(7919 * step + width)
    return torch.randn(BATCH, width, generator=g), torch.randn(BATCH, out, generator=g)


def optimizer(kind: str, params):
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.SGD(params, lr=0.1)


def train(model, opt, rank: int, world: int, *, steps: int = STEPS,
          width: int = WIDTHS[0], out: int = WIDTHS[-1]) -> None:
    """``steps`` optimizer steps on this rank's rows; ``world=1`` is the reference."""
    for step in range(steps):
        x, y = batch(step, width, out)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        opt.step()


def train_micro(model, opt, rank: int, world: int, *, no_sync=None, by_hand=None,
                steps: int = STEPS) -> list[list]:
    """``steps`` optimizer steps, each on the summed gradients of two micro-batches' mean
    losses; ``world=1`` is the reference. ``no_sync``: the first backward inside it (the second
    reduces both); ``by_hand``: both inside ``no_sync``, then ``by_hand()`` (sync_gradients).
    Returns each step's reduce-scatters, as [unit, during] (with FSDP)."""
    reductions = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(2):
            x, y = batch(100 + 2 * step + micro)
            inside = no_sync is not None and (micro == 0 or by_hand is not None)
            with no_sync() if inside else contextlib.nullcontext():
                out = model(x.chunk(world)[rank])
            nn.functional.mse_loss(out, y.chunk(world)[rank]).backward()
        if by_hand is not None:
            by_hand()
            by_hand()  # nothing left: no second reduction
        reductions.append([[c.unit, c.during] for c in getattr(model, "last_collectives", [])
                           if c.op == "reduce_scatter"])
        opt.step()
    return reductions


def probe(width: int = WIDTHS[0]) -> torch.Tensor:
    return torch.randn(6, width, generator=torch.Generator().manual_seed(424242))


def listed(state_dict: dict) -> dict[str, list]:
    return {k: v.detach().double().reshape(-1).tolist() for k, v in state_dict.items()}


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def held_tensors(module: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor the module and optimizer hold between steps: parameters, gradients,
    buffers, tensor attributes of any submodule (where gathered views would sit) and of FSDP's
    units (gathered buffers), and the optimizer's state."""
    found = [*module.parameters(), *module.buffers()]
    found += [p.grad for p in module.parameters() if p.grad is not None]
    objects = [*module.modules(), *getattr(module, "units", [])]
    found += [v for obj in objects for v in vars(obj).values() if isinstance(v, torch.Tensor)]
    found += [v for state in opt.state.values() for v in state.values()
              if isinstance(v, torch.Tensor)]
    return found


def live_tensor_bytes() -> int:
    """Bytes of every tensor alive in this process (a check that nothing else holds more)."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on deprecated torch objects warns
        warnings.simplefilter("ignore")
        return storage_bytes([o for o in gc.get_objects() if isinstance(o, torch.Tensor)])


def fsdp_report(fsdp) -> dict:
    return {"collectives": [[c.op, c.unit, c.during, c.dtype] for c in fsdp.last_collectives],
            "peak_gathered_numel": fsdp.peak_gathered_numel,
            "units": [[u.name, u.layout.numel, u.layout.padded_numel] for u in fsdp.units],
            "shard_dtypes": sorted({str(p.dtype) for p in fsdp.parameters()})}


# -- scenarios (every rank runs them in the order given) ----------------------------------------


def sgd(pg, out: Path) -> dict:
    fsdp = gradstar.FSDP(MLP(pg.rank), pg)
    train(fsdp, optimizer("sgd", fsdp.parameters()), pg.rank, pg.world_size)
    return {"state_dict": listed(fsdp.full_state_dict(rank0_only=False)), **fsdp_report(fsdp)}


def adam(pg, out: Path) -> dict:
    fsdp = gradstar.FullyShardedDataParallel(MLP(pg.rank), pg)
    opt = optimizer("adam", fsdp.parameters())
    train(fsdp, opt, pg.rank, pg.world_size)
    state_numel = sum(v.numel() for s in opt.state.values() for k, v in s.items()
                      if k != "step")
    return {"state_dict": listed(fsdp.full_state_dict(rank0_only=False)),
            "optimizer_state_numel": state_numel,
            "shard_numels": [p.numel() for p in fsdp.parameters()], **fsdp_report(fsdp)}


def no_prefetch(pg, out: Path) -> dict:
    fsdp = gradstar.FSDP(MLP(pg.rank), pg, prefetch=False)
    train(fsdp, optimizer("adam", fsdp.parameters()), pg.rank, pg.world_size)
    return {"state_dict": listed(fsdp.full_state_dict(rank0_only=False)), **fsdp_report(fsdp)}


def mixed(pg, out: Path) -> dict:
    fsdp = gradstar.FSDP(MLP(pg.rank), pg, mixed_precision="bf16")
    opt = optimizer("momentum", fsdp.parameters())
    train(fsdp, opt, pg.rank, pg.world_size)
    return {"state_dict": listed(fsdp.full_state_dict(rank0_only=False)),
            "optimizer_dtypes": sorted({str(s["momentum_buffer"].dtype)
                                        for s in opt.state.values()}), **fsdp_report(fsdp)}


def wire_int8(pg, out: Path) -> dict:
    """``mixed`` with float32 gradients reduce-scattered as int8 (per-block scales)."""
    fsdp = gradstar.FSDP(MLP(pg.rank), pg, wire="int8")
    train(fsdp, optimizer("momentum", fsdp.parameters()), pg.rank, pg.world_size)
    return {"state_dict": listed(fsdp.full_state_dict(rank0_only=False)), "wire": fsdp.wire,
            **fsdp_report(fsdp)}


def nested(pg, out: Path) -> dict:
    fsdp = gradstar.FSDP(NestedNet(pg.rank), pg, auto_wrap_policy=NESTED_POLICY)
    train(fsdp, optimizer("adam", fsdp.parameters()), pg.rank, pg.world_size)
    return {"state_dict": listed(fsdp.full_state_dict(rank0_only=False)), **fsdp_report(fsdp)}


def sync_by_hand(pg, out: Path) -> dict:
    """Both micro-batches' backward inside no_sync(), then sync_gradients() (twice)."""
    fsdp = gradstar.FSDP(MLP(pg.rank), pg)
    reductions = train_micro(fsdp, optimizer("adam", fsdp.parameters()), pg.rank,
                             pg.world_size, no_sync=fsdp.no_sync, by_hand=fsdp.sync_gradients)
    return {"state_dict": listed(fsdp.full_state_dict(rank0_only=False)),
            "reductions": reductions}


def no_sync(pg, out: Path) -> dict:
    """The first micro-batch's backward inside no_sync(), the second reduces both."""
    fsdp = gradstar.FSDP(MLP(pg.rank), pg)
    reductions = train_micro(fsdp, optimizer("adam", fsdp.parameters()), pg.rank,
                             pg.world_size, no_sync=fsdp.no_sync)
    return {"state_dict": listed(fsdp.full_state_dict(rank0_only=False)),
            "reductions": reductions}


def sync_after_backward(pg, out: Path) -> dict:
    """sync_gradients() after every synchronising backward: a no-op, not a second mean."""
    fsdp = gradstar.FSDP(MLP(pg.rank), pg)
    opt = optimizer("sgd", fsdp.parameters())
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(fsdp(x.chunk(pg.world_size)[pg.rank]),
                               y.chunk(pg.world_size)[pg.rank]).backward()
        fsdp.sync_gradients()
        opt.step()
    return {"state_dict": listed(fsdp.full_state_dict(rank0_only=False)), **fsdp_report(fsdp)}


def into_inner(pg, out: Path) -> dict:
    """Train, take the plain module back, then train it on as a plain module (every rank on
    the whole batch, as the reference does)."""
    fsdp = gradstar.FSDP(NestedNet(pg.rank), pg, auto_wrap_policy=NESTED_POLICY)
    train(fsdp, optimizer("adam", fsdp.parameters()), pg.rank, pg.world_size)
    with torch.no_grad():
        fsdp_out = fsdp(probe()).tolist()
    module = fsdp.into_inner()
    report = {"plain_parameters": all(type(p) is nn.Parameter and p.grad is None
                                      for p in module.parameters()),
              "tied": module.out.weight is module.head.weight,
              "frozen": [p.requires_grad for p in module.frozen.parameters()],
              "names": [name for name, _ in module.named_parameters()],
              "state_dict": listed(module.state_dict())}
    with torch.no_grad():
        report["plain_out"] = module(probe()).tolist()
    report["fsdp_out"] = fsdp_out
    try:
        fsdp(probe())
    except ConfigurationError as error:
        report["forward_after"] = str(error)
    train(module, optimizer("sgd", module.parameters()), 0, 1, steps=1)
    report["after_plain_step"] = listed(module.state_dict())
    return report


def checkpoint(pg, out: Path) -> dict:
    """Full state: saved from FSDP, loaded into a plain model and into a fresh FSDP."""
    fsdp = gradstar.FSDP(MLP(pg.rank), pg)
    train(fsdp, optimizer("sgd", fsdp.parameters()), pg.rank, pg.world_size)
    full = fsdp.full_state_dict()
    report = {"rank0_only_elsewhere_empty": pg.rank == 0 or full == {}}
    with torch.no_grad():
        report["fsdp_out"] = fsdp(probe()).tolist()
    if pg.rank == 0:
        torch.save(full, out / "full.pt")
        plain = MLP(99)
        plain.load_state_dict(torch.load(out / "full.pt", weights_only=True))
        with torch.no_grad():
            report["plain_out"] = plain(probe()).tolist()
    fresh = gradstar.FSDP(MLP(100 + pg.rank), pg)
    fresh.load_full_state_dict(full if pg.rank == 0 else None)
    with torch.no_grad():
        report["reloaded_out"] = fresh(probe()).tolist()
    again = fresh.full_state_dict()
    report["reloaded_state_equal"] = pg.rank != 0 or (
        list(again) == list(full) and all(torch.equal(again[k], full[k]) for k in full))
    # Training goes on from the loaded state as from the saved one.
    opt = optimizer("sgd", fresh.parameters())
    train(fresh, opt, pg.rank, pg.world_size, steps=1)
    report["after_reload_step"] = listed(fresh.full_state_dict(rank0_only=False))
    broken = dict(full)
    if pg.rank == 0:
        del broken["fc2.bias"]
        broken["fc1.weight"] = torch.zeros(2, 2)
    try:
        fresh.load_full_state_dict(broken if pg.rank == 0 else None)
        report["bad_checkpoint"] = None
    except ConfigurationError as error:
        report["bad_checkpoint"] = str(error)
    return report


def sharded(pg, out: Path) -> dict:
    """Per-rank state: saved, merged offline by the test, loaded back into a fresh FSDP."""
    fsdp = gradstar.FSDP(NestedNet(pg.rank), pg, auto_wrap_policy=NESTED_POLICY)
    train(fsdp, optimizer("adam", fsdp.parameters()), pg.rank, pg.world_size)
    torch.save(fsdp.sharded_state_dict(), out / f"sharded-{pg.rank}.pt")
    fresh = gradstar.FSDP(NestedNet(100 + pg.rank), pg, auto_wrap_policy=NESTED_POLICY)
    fresh.load_sharded_state_dict(torch.load(out / f"sharded-{pg.rank}.pt", weights_only=True))
    with torch.no_grad():
        same = torch.equal(fresh(probe()), fsdp(probe()))
    report = {"reloaded_outputs_equal": same}
    try:
        mine = fsdp.sharded_state_dict()
        mine["rank"] = (pg.rank + 1) % pg.world_size
        fresh.load_sharded_state_dict(mine)
        report["wrong_rank"] = None
    except ConfigurationError as error:
        report["wrong_rank"] = str(error)
    return report


def staged(pg, out: Path) -> dict:
    """``nested`` with the CPU declared a staged device, so that every gather, reduction and
    broadcast takes the path of a CUDA tensor (a host copy made when the collective is issued,
    the result a new tensor copied back); then its full state dict loaded into a fresh FSDP."""
    saved = device.STAGED_DEVICES
    device.STAGED_DEVICES = ("cuda", "cpu")
    try:
        fsdp = gradstar.FSDP(NestedNet(pg.rank), pg, auto_wrap_policy=NESTED_POLICY)
        train(fsdp, optimizer("adam", fsdp.parameters()), pg.rank, pg.world_size)
        full = fsdp.full_state_dict(rank0_only=False)
        fresh = gradstar.FSDP(NestedNet(100 + pg.rank), pg, auto_wrap_policy=NESTED_POLICY)
        fresh.load_full_state_dict(full if pg.rank == 0 else None)
        with torch.no_grad():
            same = torch.equal(fresh(probe()), fsdp(probe()))
        return {"state_dict": listed(full), "reloaded_outputs_equal": same,
                "staged": all(device.is_staged(p) for p in fsdp.parameters()),
                **fsdp_report(fsdp)}
    finally:
        device.STAGED_DEVICES = saved


def memory(pg, out: Path) -> dict:
    """Adam on a 16-unit model: what each rank keeps between steps."""
    fsdp = gradstar.FSDP(memory_model(pg.rank), pg)
    opt = optimizer("adam", fsdp.parameters())
    train(fsdp, opt, pg.rank, pg.world_size, steps=2, width=MEMORY_WIDTH, out=MEMORY_WIDTH)
    report = fsdp_report(fsdp)
    del report["collectives"]
    return {"held_bytes": storage_bytes(held_tensors(fsdp, opt)),
            "live_bytes": live_tensor_bytes(), **report}


def plan_mismatch(pg, out: Path) -> dict:
    """Rank 1 wraps a different model, then uses another mixed precision, then another wire
    format: all refused."""
    errors = []
    widths = (5, 9, 14, 17, 3) if pg.rank == 1 else WIDTHS
    for model, precision, wire in [(MLP(pg.rank, widths), None, None),
                                   (MLP(pg.rank), "bf16" if pg.rank == 1 else None, None),
                                   (MLP(pg.rank), None, "int8" if pg.rank == 1 else "int4")]:
        try:
            gradstar.FSDP(model, pg, mixed_precision=precision, wire=wire)
            errors.append(None)
        except ConfigurationError as error:
            errors.append(str(error))
    return {"errors": errors}


def diverged(pg, out: Path) -> dict:
    """Rank 0 saves while the others load: a named error on every rank, promptly. Runs on a
    process group of its own, which the mismatch leaves with unmatched collectives."""
    with gradstar.init_process_group(job=f"{pg.job}-diverged", world_size=pg.world_size,
                                     rank=pg.rank, timeout=30, join_timeout=60) as own:
        fsdp = gradstar.FSDP(MLP(own.rank), own)
        started = time.monotonic()
        try:
            if own.rank == 0:
                fsdp.full_state_dict()
            else:
                fsdp.load_full_state_dict(None)
            error = None
        except GradstarError as exc:
            error = {"type": type(exc).__name__, "message": str(exc)}
        seconds = time.monotonic() - started
    return {"error": error, "seconds": seconds}


def rank_death(pg, out: Path) -> dict:
    """Rank 1 dies after its second forward; the others' backward must name it, not hang."""
    fsdp = gradstar.FSDP(MLP(pg.rank), pg)
    opt = optimizer("sgd", fsdp.parameters())
    started = time.monotonic()
    try:
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            loss = nn.functional.mse_loss(fsdp(x.chunk(pg.world_size)[pg.rank]),
                                          y.chunk(pg.world_size)[pg.rank])
            if step == 1 and pg.rank == 1:
                print(json.dumps({"scenario": "rank_death", "world": pg.world_size,
                                  "rank": pg.rank, "died": True}), flush=True)
                os._exit(0)  # no goodbye to the coordinator: the connection just drops
            loss.backward()
            opt.step()
    except GradstarError as exc:
        return {"error": type(exc).__name__, "message": str(exc),
                "lost": getattr(exc, "rank", None), "seconds": time.monotonic() - started}
    return {"error": None}


SCENARIOS = {"sgd": sgd, "adam": adam, "no_prefetch": no_prefetch, "mixed": mixed,
             "wire_int8": wire_int8,
             "nested": nested, "checkpoint": checkpoint, "sharded": sharded, "staged": staged,
             "memory": memory, "sync_by_hand": sync_by_hand, "no_sync": no_sync,
             "sync_after_backward": sync_after_backward, "into_inner": into_inner,
             "plan_mismatch": plan_mismatch, "diverged": diverged, "rank_death": rank_death}


def main() -> int:
    out, groups = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)  # the ranks share two cores with the hub and the test process
    rank = int(os.environ["GRADSTAR_RANK"])
    for group in groups:
        world, names = group.split(":")
        if rank >= int(world):
            continue
        with gradstar.init_process_group(job=f"{os.environ['GRADSTAR_JOB']}-{world}",
                                         world_size=int(world), rank=rank, timeout=60,
                                         join_timeout=60) as pg:
            for name in names.split(","):
                def timed(scenario=SCENARIOS[name]) -> dict:
                    started = time.monotonic()
                    return {**scenario(pg, out), "took": time.monotonic() - started}

                if not run_scenario(name, rank, timed, world=pg.world_size):
                    return 3
                if name == "rank_death":
                    return 0  # the generation is over: no barrier
            pg.barrier()  # nobody leaves while a peer is still in its last collective
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
