"""FSDP memory: what each of 4 FullyShardedDataParallel ranks holds vs one unsharded process.

What is measured
    The same MLP (``--layers`` Linear(width, width) layers with ReLU between them, float32,
    default 24 x 1024: 25.2M parameters, 100.7 MB, each layer a sharding unit of 4.2% of the
    model) is trained with Adam for ``--steps`` steps in two configurations, run one after the
    other in this invocation:

    * unsharded: one spawned process, the plain model on the whole batch (``--ranks`` x
      ``--batch`` rows), no communication;
    * fsdp: ``--ranks`` spawned processes (default 4) and a ``gradstar coordinator`` subprocess
      on 127.0.0.1; ``gradstar.FSDP(model, pg)`` (default policy: each Linear is a unit, so a
      rank gathers at most two layers at once) and Adam on ``fsdp.parameters()``, each rank on
      its ``--batch`` rows.

    Per process it reports:

    * persistent MB: the distinct tensor storages held between steps by the model (parameters,
      gradients, buffers, tensor attributes of every submodule and of FSDP's units) and by the
      optimizer (its state), and "live MB": every tensor alive in the process (``gc``), which
      would show a gathered copy kept anywhere. ratio = persistent / the unsharded persistent.
    * RSS: the resident set after imports and set-up, before the model is built ("baseline");
      the peak while training ("train peak", Linux VmHWM, reset after construction and a
      ``malloc_trim``, so construction does not count); and the peak over the whole process
      ("process peak", ``ru_maxrss``). FSDP builds the whole model on every rank before
      sharding it (no meta-device initialisation), so its process peak includes one full model.

    Both configurations run with gradstar's allocator thresholds (``tune_allocator``, as every
    process group sets them), which keep freed buffers in the heap (trim threshold 512 MB): the
    unit-sized gather, gradient and chunk buffers each step allocates and frees stay resident,
    in every thread's malloc arena. ``--no-tune-allocator`` leaves glibc's defaults; with
    ``MALLOC_ARENA_MAX=2 MALLOC_TRIM_THRESHOLD_=0`` in the environment as well, RSS follows what
    is live more closely. Correctness is checked, not assumed: the FSDP ranks start from
    different seeds, and the largest difference between FSDP's final parameters (from
    ``full_state_dict()``) and the unsharded run's is printed (float32 rounding only).

How to reproduce
    .venv/bin/python benchmarks/fsdp_memory.py                 # 4 ranks, 24 x 1024, 3 steps
    .venv/bin/python benchmarks/fsdp_memory.py --layers 12 --width 512 --steps 2 --json out.json
    MALLOC_ARENA_MAX=2 MALLOC_TRIM_THRESHOLD_=0 .venv/bin/python benchmarks/fsdp_memory.py \
        --no-tune-allocator
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import resource
import signal
import sys
import time
import uuid
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    BenchmarkError,
    CoordinatorProcess,
    add_run_arguments,
    format_table,
    run_ranks,
    write_json,
)

MB = 1e6
SAMPLE_EVERY = 997  # every 997th parameter element is compared between the runs


# -- measuring (in the rank processes) ---------------------------------------------------------


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise BenchmarkError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    """Return free heap memory to the OS, then restart the VmHWM high-water mark (Linux)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def _storage_bytes(tensors) -> int:
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _persistent_bytes(module, opt) -> int:
    import torch

    found = [*module.parameters(), *module.buffers()]
    found += [p.grad for p in module.parameters() if p.grad is not None]
    objects = [*module.modules(), *getattr(module, "units", [])]
    found += [v for obj in objects for v in vars(obj).values() if isinstance(v, torch.Tensor)]
    found += [v for state in opt.state.values() for v in state.values()
              if isinstance(v, torch.Tensor)]
    return _storage_bytes(found)


def _live_bytes() -> int:
    import torch

    gc.collect()
    with warnings.catch_warnings():  # isinstance() on deprecated torch objects warns
        warnings.simplefilter("ignore")
        return _storage_bytes([o for o in gc.get_objects() if isinstance(o, torch.Tensor)])


def _model(layers: int, width: int, seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    parts = []
    for _ in range(layers):
        parts += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*parts[:-1])


def _data(width: int, rows: int, step: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)


def _warm_up() -> None:
    """Pay torch's one-off costs (the first optimizer imports torch._dynamo) before measuring."""
    import torch

    torch.optim.Adam([torch.zeros(1, requires_grad=True)])


def _train(step_model, params_module, rows: slice, total_rows: int, width: int,
           steps: int) -> dict:
    import torch

    opt = torch.optim.Adam(params_module.parameters(), lr=1e-4)
    _reset_peak_rss()
    start_rss = _status_kb("VmRSS")
    times = []
    for step in range(steps):
        x, y = _data(width, total_rows, step)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(step_model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        del x, y, loss
    return {"persistent": _persistent_bytes(params_module, opt), "live": _live_bytes(),
            "train_start_rss_kb": start_rss, "train_peak_rss_kb": _status_kb("VmHWM"),
            "step_seconds": times}


def unsharded_rank(rank: int, world_size: int, layers: int, width: int, rows: int,
                   steps: int, tune: bool) -> dict:
    import torch

    from gradstar.allocator import tune_allocator

    torch.set_num_threads(1)
    if tune:  # the same malloc settings as the FSDP ranks get from their process group
        tune_allocator()
    _warm_up()
    baseline = _status_kb("VmRSS")
    model = _model(layers, width, seed=0)
    result = _train(model, model, slice(0, rows), rows, width, steps)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {**result, "baseline_rss_kb": baseline, "sample": flat[::SAMPLE_EVERY].tolist(),
            "params": flat.numel(), "units": None,
            "process_peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def fsdp_rank(rank: int, world_size: int, address: str, job: str, layers: int, width: int,
              batch: int, steps: int, tune: bool) -> dict:
    import torch

    import gradstar

    torch.set_num_threads(1)
    pg = gradstar.init_process_group(coordinator=address, job=job, world_size=world_size,
                                     rank=rank, timeout=600, tune_allocator=tune)
    try:
        _warm_up()
        baseline = _status_kb("VmRSS")
        fsdp = gradstar.FSDP(_model(layers, width, seed=rank), pg)
        rows = slice(rank * batch, (rank + 1) * batch)
        result = _train(fsdp, fsdp, rows, world_size * batch, width, steps)
        result["peak_gathered_mb"] = fsdp.peak_gathered_numel * 4 / MB
        result["units"] = len(fsdp.units)
        result["largest_unit_mb"] = max(u.layout.numel for u in fsdp.units) * 4 / MB
        full = fsdp.full_state_dict()  # after the measurements: it gathers the model on rank 0
        if rank == 0:
            flat = torch.cat([v.reshape(-1) for k, v in full.items()])
            result["sample"] = flat[::SAMPLE_EVERY].tolist()
        del full
        result["baseline_rss_kb"] = baseline
        result["process_peak_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        pg.barrier()
    finally:
        pg.close()
    return result


# -- driver ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="FSDP memory per rank vs one unsharded process.")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8, help="rows per rank per step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-tune-allocator", action="store_true",
                        help="keep glibc's malloc defaults in both configurations")
    add_run_arguments(parser, timeout=900.0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not Path("/proc/self/clear_refs").exists():
        print("fsdp_memory needs Linux (/proc/self/status, /proc/self/clear_refs)")
        return 2
    params = args.layers * (args.width * args.width + args.width)
    tune = not args.no_tune_allocator
    malloc_env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    print(f"gradstar FSDP memory benchmark: {os.cpu_count()} CPUs, MLP {args.layers} x "
          f"Linear({args.width}, {args.width}) = {params / 1e6:.1f}M parameters "
          f"({params * 4 / MB:.1f} MB float32), Adam, {args.steps} steps, {args.ranks} ranks x "
          f"batch {args.batch}; allocator {'tuned' if tune else 'glibc defaults'} "
          f"{malloc_env or ''}", flush=True)

    t0 = time.monotonic()
    (unsharded,) = run_ranks(unsharded_rank, 1, (args.layers, args.width,
                                                  args.ranks * args.batch, args.steps, tune),
                             timeout=args.timeout, label="unsharded")
    print(f"  unsharded done ({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with CoordinatorProcess() as coord:
        ranks = run_ranks(fsdp_rank, args.ranks,
                          (coord.address, f"bench-fsdp-{uuid.uuid4().hex[:8]}", args.layers,
                           args.width, args.batch, args.steps, tune),
                          timeout=args.timeout, label="fsdp")
    print(f"  fsdp done ({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)

    base = unsharded["persistent"]
    rows = []
    for name, r in [("unsharded", unsharded)] + [(f"fsdp rank {i}", r)
                                                 for i, r in enumerate(ranks)]:
        above = r["train_peak_rss_kb"] - r["baseline_rss_kb"]
        rows.append([name, f"{r['persistent'] / MB:.1f}", f"{r['live'] / MB:.1f}",
                     f"{r['persistent'] / base:.3f}", f"{r['baseline_rss_kb'] / 1e3:.0f}",
                     f"{r['train_peak_rss_kb'] / 1e3:.0f}", f"{above / 1e3:.0f}",
                     f"{r['process_peak_rss_kb'] / 1e3:.0f}",
                     f"{sorted(r['step_seconds'])[len(r['step_seconds']) // 2]:.2f}"])
    print()
    print(format_table(["process", "persistent MB", "live MB", "ratio", "baseline RSS MB",
                        "train peak RSS MB", "train peak - baseline", "process peak RSS MB",
                        "median s/step"], rows))
    unsharded_above = unsharded["train_peak_rss_kb"] - unsharded["baseline_rss_kb"]
    fsdp_above = max(r["train_peak_rss_kb"] - r["baseline_rss_kb"] for r in ranks)
    worst = max(abs(a - b) for a, b in zip(ranks[0]["sample"], unsharded["sample"],
                                            strict=True))
    ratio = max(r["persistent"] for r in ranks) / base
    print(f"\npersistent storage per rank / unsharded: {ratio:.3f} (largest rank); training "
          f"peak RSS above baseline per rank / unsharded: {fsdp_above / unsharded_above:.3f}")
    print(f"{ranks[0]['units']} units, the largest {ranks[0]['largest_unit_mb']:.1f} MB; at most "
          f"{max(r['peak_gathered_mb'] for r in ranks):.1f} MB gathered at once per rank; "
          f"max |FSDP param - unsharded param| over {len(unsharded['sample'])} samples: "
          f"{worst:.1e}")
    if args.json:
        write_json(args, "fsdp_memory", unsharded=unsharded, fsdp=ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
