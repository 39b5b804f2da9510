"""Pipeline training throughput and activation memory: GPipe vs 1F1B over gradstar peer streams.

What is measured
    An MLP of ``--stages`` (default 4) equal stages, each ``--layers-per-stage`` Linear+ReLU
    layers of width ``--width`` (float32), is trained with SGD by one spawned process per
    stage: ``gradstar.Pipeline(stage, pg, num_microbatches=M, schedule=...)`` with a
    ``gradstar coordinator`` subprocess on 127.0.0.1 for the rendezvous, and activations and
    gradients on the stages' own peer streams. Configurations:

    * gpipe, 1f1b: the pipeline with each schedule. Both run in the same stage processes, each
      on its own copy of the stage (same seed), step by step in alternating order, so both
      see the same background load (this machine is shared);
    * local: afterwards, the unsplit model in one process on the whole batch (the compute
      floor of one core, no communication).

    Every stage runs ``--warmup`` untimed steps, then ``--iters`` timed steps of
    ``zero_grad(); pipe.step(...); opt.step()`` per schedule (each preceded by an untimed
    barrier so the stages start together). Each process uses one torch thread. Throughput =
    batch / the last stage's median step time; "blocked" is the median time a stage's step
    spent waiting for its neighbours (``Pipeline.wait_seconds``). Memory is measured, not
    derived from the schedule: the pipeline counts the bytes of tensors held for backward
    (autograd's saved tensors, excluding parameters, plus the outputs kept for the backward
    pass), and the table shows each stage's peak during a step, next to the most micro-batches
    alive at once.

    Correctness is checked, not assumed: both schedules start from the same seeded
    parameters and train on the same batches, every stage reports a sample of its final
    parameters, and the largest difference between the two schedules is printed (float32
    rounding only).

How to reproduce
    .venv/bin/python benchmarks/pipeline.py                        # 4 stages, M=8, batch 256
    .venv/bin/python benchmarks/pipeline.py --microbatches 16 --width 2048 --json out.json
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    BenchmarkError,
    CoordinatorProcess,
    MiB,
    add_run_arguments,
    finish,
    format_table,
    loadavg,
    median,
    run_ranks,
)

SAMPLE_EVERY = 997
SCHEDULES = ("gpipe", "1f1b")


# -- rank bodies (run in spawned processes) ----------------------------------------------------


def _stages(n_stages: int, width: int, layers: int):
    """The whole model as a list of stage modules, from one seed."""
    import torch
    from torch import nn

    torch.manual_seed(1234)
    stages = []
    for _ in range(n_stages):
        mods = []
        for _ in range(layers):
            mods += [nn.Linear(width, width), nn.ReLU()]
        stages.append(nn.Sequential(*mods))
    return stages


def _data(step: int, batch: int, width: int):
    import torch

    g = torch.Generator().manual_seed(step)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def _sample(modules) -> list[float]:
    import torch

    flat = torch.cat([p.detach().reshape(-1) for m in modules for p in m.parameters()])
    return flat[::SAMPLE_EVERY].tolist()


def pipeline_rank(rank: int, world_size: int, address: str, job: str, width: int,
                  layers: int, batch: int, microbatches: int, warmup: int, iters: int) -> dict:
    """Both schedules in one process group, step by step in alternating order, so both see the
    same background load; each has its own copy of the stage, from the same seed."""
    import torch
    from torch import nn

    import gradstar

    torch.set_num_threads(1)
    pg = gradstar.init_process_group(coordinator=address, job=job, world_size=world_size,
                                     rank=rank, timeout=300)
    results = {}
    try:
        runs = {}
        for schedule in SCHEDULES:
            stage = _stages(world_size, width, layers)[rank]
            runs[schedule] = (stage, torch.optim.SGD(stage.parameters(), lr=1e-3),
                              gradstar.Pipeline(stage, pg, num_microbatches=microbatches,
                                                schedule=schedule))
            results[schedule] = {"times": [], "peaks": [], "live": [], "waits": []}
        for step in range(warmup + iters):
            x, y = _data(step, batch, width)
            order = SCHEDULES if step % 2 == 0 else SCHEDULES[::-1]
            for schedule in order:
                _, opt, pipe = runs[schedule]
                pg.barrier()
                t0 = time.perf_counter()
                opt.zero_grad()
                pipe.step(inputs=x if pipe.is_first else None,
                          targets=y if pipe.is_last else None, loss_fn=nn.functional.mse_loss)
                opt.step()
                if step >= warmup:
                    r = results[schedule]
                    r["times"].append(time.perf_counter() - t0)
                    r["peaks"].append(pipe.peak_activation_bytes)
                    r["live"].append(pipe.max_live_activations)
                    r["waits"].append(pipe.wait_seconds)
        pg.barrier()
    finally:
        pg.close()
    return {schedule: {"times": r["times"], "peak_bytes": max(r["peaks"]),
                       "max_live": max(r["live"]), "waits": r["waits"],
                       "sample": _sample([runs[schedule][0]])}
            for schedule, r in results.items()}


def local_rank(rank: int, world_size: int, n_stages: int, width: int, layers: int, batch: int,
               warmup: int, iters: int) -> dict:
    import torch
    from torch import nn

    torch.set_num_threads(1)
    model = nn.Sequential(*_stages(n_stages, width, layers))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for step in range(warmup + iters):
        x, y = _data(step, batch, width)
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return {"times": times}


# -- driver ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Pipeline throughput: GPipe vs 1F1B.")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=8)
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import torch

    print(f"gradstar pipeline benchmark: torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{args.stages} stages x {args.layers_per_stage} Linear({args.width}) + ReLU, "
          f"batch {args.batch} in {args.microbatches} micro-batches, {args.warmup}+{args.iters} "
          f"steps, load average {loadavg()}", flush=True)
    runs: dict[str, list[dict] | None] = {}
    failures = []
    t0 = time.monotonic()
    try:
        with CoordinatorProcess() as coord:
            by_rank = run_ranks(
                pipeline_rank, args.stages,
                (coord.address, f"bench-pipe-{uuid.uuid4().hex[:8]}", args.width,
                 args.layers_per_stage, args.batch, args.microbatches, args.warmup, args.iters),
                timeout=args.timeout, label="pipeline")
        for schedule in SCHEDULES:
            runs[schedule] = [r[schedule] for r in by_rank]
        print(f"  pipelines done ({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
    except BenchmarkError as error:
        runs.update(dict.fromkeys(SCHEDULES))
        failures.append(("pipeline", str(error)))
        print("  pipelines FAILED", file=sys.stderr, flush=True)
    try:
        runs["local"] = run_ranks(
            local_rank, 1, (args.stages, args.width, args.layers_per_stage, args.batch,
                            args.warmup, args.iters), timeout=args.timeout, label="local")
    except BenchmarkError as error:
        runs["local"] = None
        failures.append(("local", str(error)))

    rows, summary = [], {}
    for name, results in runs.items():
        if results is None:
            rows.append([name, "FAILED", "-", "-", "-", "-"])
            continue
        ms = median(results[-1]["times"]) * 1e3
        per_stage = (" / ".join(f"{r['peak_bytes'] / MiB:.1f}" for r in results)
                     if name != "local" else "-")
        live = " / ".join(str(r["max_live"]) for r in results) if name != "local" else "-"
        waits = (" / ".join(f"{median(r['waits']) * 1e3:.0f}" for r in results)
                 if name != "local" else "-")
        rows.append([name, f"{ms:.1f}", f"{args.batch / ms * 1e3:.0f}", per_stage, live, waits])
        summary[name] = {"median_ms": ms, "samples_per_s": args.batch / ms * 1e3,
                         "last_stage_times_ms": [t * 1e3 for t in results[-1]["times"]]}
        if name != "local":
            summary[name] |= {"peak_activation_bytes": [r["peak_bytes"] for r in results],
                              "max_live_activations": [r["max_live"] for r in results],
                              "median_wait_ms": [median(r["waits"]) * 1e3 for r in results]}
    print()
    print(format_table(["schedule", "ms/step", "samples/s",
                        "peak activation MiB, stage 0 / 1 / ...", "max live micro-batches",
                        "ms blocked on neighbours"], rows))
    gpipe, one_f = runs.get("gpipe"), runs.get("1f1b")
    if gpipe and one_f:
        diff = max(abs(a - b) for g, o in zip(gpipe, one_f, strict=True)
                   for a, b in zip(g["sample"], o["sample"], strict=True))
        ratio = [o["peak_bytes"] / g["peak_bytes"] for g, o in zip(gpipe, one_f, strict=True)]
        print(f"\n1F1B / GPipe peak activation memory per stage: "
              f"{' / '.join(f'{r:.2f}' for r in ratio)}; max |param(gpipe) - param(1f1b)| "
              f"{diff:.1e}")
        summary["max_param_diff"] = diff
    print(f"last stage's median over {args.iters} timed steps; local = the unsplit model in one "
          f"process; load average at end {loadavg()}")
    return finish(args, "pipeline", summary, failures)


if __name__ == "__main__":
    raise SystemExit(main())
