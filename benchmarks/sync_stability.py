"""Every sync mode against Synchronous at the same learning rate, with and without a straggler
(issue 49: which step scaling and which wait keep BoundedStaleness and Asynchronous stable and
as good as Synchronous): one host, real rank processes and a real coordinator, a straggler
emulated by sleeping.

The runs
    ``--ranks`` ranks (default 4) of one job; before each backward every rank sleeps
    ``--step-seconds``, the last rank ``--slowdown`` times as long (1: no straggler). Every
    rank runs ``--iters`` iterations on its own batches (equal data per rank), torch SGD at
    ``--lr`` with momentum 0.9 (constant), then ``ddp.synchronize()``. The rank processes stay
    up for every configuration (each its own job on the same coordinator): torch is imported
    once, and no configuration pays another's start.

The problems (data generated here, seeded)
    ``regression``: an MLP 8-64-2 (tanh) fitting ``sin(x A) + 0.1 x B`` plus noise, 16 rows per
    rank and iteration; metric: test MSE (lower is better). ``spirals``: the demo's spirals MLP
    (hidden 64), 32 rows per rank and iteration; metric: test accuracy (higher is better).
    ``cnn``: a small CNN telling the orientation of noisy 12x12 gratings (4 classes,
    :func:`gratings`), 32 images per rank and iteration; metric: test accuracy. ``--seeds``
    runs per point (the seed picks the model's initialisation and the batches; the timing
    differs from run to run by itself).

The configurations
    Synchronous, then BoundedStaleness(``--max-staleness``) and Asynchronous with each of
    ``--scalings`` (``plain``: the weighted mean as it is; ``share``: times the step's share
    of the live ranks; ``staleness``: each contribution over 1 + its staleness; both) and
    each of ``--stale-timeouts`` (``adaptive``: the default; seconds, shown as ``@t``; ``0``:
    no wait for one's own step, the rule before), and
    Quorum(min_ranks=n-1) with each of ``--quorum-timeouts`` (``adaptive``: the default;
    seconds; ``/scaling``: its step scaling, e.g. ``adaptive/plain``, the rule before the
    default ``share``). ``--modes`` picks among them.

What is printed (nothing asserted; ``--json`` saves it)
    Per problem, configuration: the metric of each run and their median, the median relative
    to Synchronous's (loss: ratio; accuracy: difference in points), diverged runs (a loss over
    10x Synchronous's median, or not finite; accuracy under 1.5 / classes), steps the hub
    closed per rank iteration, the share of all gradients dropped, from rank 0's record of the
    steps it applied (the hub's): their mean number of gradients, the mean staleness of those
    gradients and the mean step scale (sum of the factors), the fast ranks' seconds for
    their iterations over Synchronous's (median; below 1: sooner), the slowest rank's the same
    way (``all s``: the whole job's time; steps/s is its inverse), and whether every rank
    ended bitwise identical.

Run: ``.venv/bin/python benchmarks/sync_stability.py --slowdown 3`` (and ``--slowdown 1``:
no straggler; ``--step-seconds 0 --slowdown 1 --modes ...``: each mode's steps/s against
Synchronous's, the inverse of the time column).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import CoordinatorProcess, format_table, loadavg, run_ranks

SCALINGS = ("plain", "share", "staleness", "share+staleness")


def make_problem(name: str, seed: int):
    """(model, batches(rank, i) -> (x, y), loss function, test split, metric name)."""
    import numpy as np
    import torch
    from torch import nn

    if name == "spirals":
        from gradstar.worker.demo import spirals

        data = spirals.make_spirals(6000, seed=0)
        model = spirals.make_model(data.features, data.classes, 64, seed=seed)
        x, y = torch.from_numpy(data.train.x), torch.from_numpy(data.train.y)

        def batch(rank: int, world: int, i: int):
            rows = torch.Generator().manual_seed(seed * 100_003 + rank * 10_007 + i)
            pick = torch.randint(0, len(y), (32,), generator=rows)
            return x[pick], y[pick]

        return model, batch, nn.functional.cross_entropy, (
            torch.from_numpy(data.test.x), torch.from_numpy(data.test.y)), "accuracy"
    if name == "cnn":
        return cnn_problem(seed)
    rng = np.random.default_rng(12345)
    a = torch.from_numpy(rng.normal(size=(8, 2)).astype(np.float32))
    b = torch.from_numpy(rng.normal(size=(8, 2)).astype(np.float32))

    def sample(g: torch.Generator, rows: int):
        x = torch.randn(rows, 8, generator=g)
        return x, torch.sin(x @ a) + 0.1 * (x @ b) + 0.05 * torch.randn(rows, 2, generator=g)

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 2))

    def batch(rank: int, world: int, i: int):
        return sample(torch.Generator().manual_seed(seed * 100_003 + rank * 10_007 + i), 16)

    return model, batch, nn.functional.mse_loss, sample(
        torch.Generator().manual_seed(999), 2048), "mse"


#: The cnn problem's images: side, orientation classes, noise, rows per rank and iteration.
CNN_SIDE, CNN_CLASSES, CNN_NOISE, CNN_ROWS = 12, 4, 1.8, 32


def gratings(count: int, seed: int):
    """``count`` noisy CNN_SIDE x CNN_SIDE gratings (float32, one channel) and their class: the
    stripes' orientation, one of CNN_CLASSES angles, at a random frequency and phase."""
    import numpy as np

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CNN_CLASSES, count)
    angle = labels * np.pi / CNN_CLASSES + rng.normal(0, 0.1, count)
    freq = rng.uniform(0.6, 1.4, count)
    phase = rng.uniform(0, 2 * np.pi, count)
    grid = np.arange(CNN_SIDE) - (CNN_SIDE - 1) / 2
    yy, xx = np.meshgrid(grid, grid, indexing="ij")
    along = (np.cos(angle)[:, None, None] * xx + np.sin(angle)[:, None, None] * yy)
    images = np.sin(freq[:, None, None] * along + phase[:, None, None])
    images += CNN_NOISE * rng.normal(size=images.shape)
    return images[:, None].astype(np.float32), labels.astype(np.int64)


def cnn_problem(seed: int):
    """A small CNN (two 3x3 convolutions, 8 and 16 channels, global average pooling) that
    tells the orientation of noisy gratings (:func:`gratings`); metric: test accuracy."""
    import torch
    from torch import nn

    x, y = (torch.from_numpy(v) for v in gratings(8000, 0))
    test = tuple(torch.from_numpy(v) for v in gratings(2000, 1))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, CNN_CLASSES))

    def batch(rank: int, world: int, i: int):
        rows = torch.Generator().manual_seed(seed * 100_003 + rank * 10_007 + i)
        pick = torch.randint(0, len(y), (CNN_ROWS,), generator=rows)
        return x[pick], y[pick]

    return model, batch, nn.functional.cross_entropy, test, "accuracy"


#: Classes of each accuracy problem (a run under 1.5 / classes "diverged").
CLASSES = {"spirals": 3, "cnn": CNN_CLASSES}


def make_mode(config: dict):
    import gradstar

    if config["mode"] == "quorum":  # every rank but one; its column is timeout[/scaling]
        timeout, _, scaling = config["scaling"].partition("/")
        return gradstar.Quorum(config["world"] - 1,
                               timeout=None if timeout == "adaptive" else float(timeout),
                               **({"scaling": scaling} if scaling else {}))
    # The stale modes' column is scaling[@timeout] (no @: the adaptive default).
    scaling, _, timeout = config["scaling"].partition("@")
    options = {"scaling": scaling, "timeout": float(timeout) if timeout else None}
    if config["mode"] == "bounded":
        return gradstar.BoundedStaleness(config["max_staleness"], **options)
    if config["mode"] == "async":
        return gradstar.Asynchronous(**options)
    return gradstar.Synchronous()


def rank_main(rank: int, world: int, address: str, configs: list[dict]) -> list[dict]:
    """Every configuration in turn on this rank: its metric, timing and parameters' hash."""
    import torch

    import gradstar

    torch.set_num_threads(1)
    out = []
    for config in configs:
        model, batch, loss_fn, (tx, ty), metric = make_problem(config["problem"],
                                                               config["seed"])
        opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
        config = {**config, "world": world}
        pg = gradstar.init_process_group(coordinator=address, job=config["job"],
                                         world_size=world, rank=rank, timeout=120)
        ddp = gradstar.DDP(model, pg, sync_mode=make_mode(config), optimizer=opt)
        pause = config["step_seconds"] * (config["slowdown"] if rank == world - 1 else 1)
        decay = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, config["iters"])
                 if config["schedule"] == "cosine" else None)
        every, snaps = config["snap_every"] if rank == 0 else 0, []
        began = time.perf_counter()
        for i in range(config["iters"]):
            x, y = batch(rank, world, i)
            opt.zero_grad()
            time.sleep(pause)
            loss_fn(ddp(x), y).backward()
            opt.step()
            if decay is not None:
                decay.step()
            if every and (i + 1) % every == 0:  # a copy now, evaluated after the loop
                snaps.append((time.perf_counter() - began, _flat(model).copy()))
        loop = time.perf_counter() - began
        ddp.synchronize()
        stats = ddp.sync_stats()
        value = evaluate(model, loss_fn, tx, ty, metric)
        curve = [(t, evaluate(_load(model, v), loss_fn, tx, ty, metric)) for t, v in snaps]
        flat = _flat(model)
        out.append({"job": config["job"], "metric": value, "loop_s": loop, "curve": curve,
                    "waited_s": stats.waited_seconds if stats else 0.0,
                    "steps": stats.step if stats else config["iters"],
                    "dropped": stats.dropped if stats else 0,
                    "staleness": _mean(stats.step_staleness) if stats else 0.0,
                    "scale": (statistics.fmean(e.scale for e in stats.recent_steps)
                              if stats and stats.recent_steps else 1.0),
                    "sizes": (_mean(stats.step_sizes) if stats else world),
                    "sha": hashlib.sha256(flat.tobytes()).hexdigest()})
        pg.close()
    return out


def evaluate(model, loss_fn, tx, ty, metric: str) -> float:
    import torch

    with torch.no_grad():
        pred = model(tx)
        return (float((pred.argmax(1) == ty).float().mean()) if metric == "accuracy"
                else float(loss_fn(pred, ty)))


def _flat(model):
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def _load(model, flat):
    """A copy of ``model`` with the parameters ``flat`` (a snapshot's)."""
    import copy

    import torch

    other, at = copy.deepcopy(model), 0
    with torch.no_grad():
        for p in other.parameters():
            p.copy_(torch.from_numpy(flat[at:at + p.numel()]).reshape(p.shape))
            at += p.numel()
    return other


def _mean(counts) -> float:
    """The mean of a Counter of values (0 when empty)."""
    total = sum(counts.values())
    return sum(v * c for v, c in counts.items()) / total if total else 0.0


def configurations(args) -> list[dict]:
    configs = []
    for problem in args.problems:
        for seed in range(args.seeds):
            modes = [("sync", "plain")] + [
                (m, s if t == "adaptive" else f"{s}@{t}") for m in ("bounded", "async")
                if m in args.modes for s in args.scalings for t in args.stale_timeouts]
            modes += [("quorum", t) for t in args.quorum_timeouts if "quorum" in args.modes]
            for mode, scaling in modes:
                configs.append({
                    "problem": problem, "seed": seed, "mode": mode, "scaling": scaling,
                    "job": f"{problem}-{seed}-{mode}-{scaling}", "lr": args.lr[problem],
                    "iters": args.iters[problem], "step_seconds": args.step_seconds,
                    "slowdown": args.slowdown, "max_staleness": args.max_staleness,
                    "schedule": args.schedule, "snap_every": args.snap_every})
    return configs


def report(configs: list[dict], results: list[list[dict]], ranks: int) -> tuple[str, list]:
    rows, table = [], []
    by_job = {c["job"]: c for c in configs}
    runs: dict[tuple, list[dict]] = {}
    for per_rank in zip(*results, strict=True):
        config = by_job[per_rank[0]["job"]]
        runs.setdefault((config["problem"], config["mode"], config["scaling"]), []).append({
            "metric": per_rank[0]["metric"], "steps": per_rank[0]["steps"] / config["iters"],
            "fast_s": statistics.median(r["loop_s"] for r in per_rank[:-1]),
            "all_s": max(r["loop_s"] for r in per_rank),
            "dropped": sum(r["dropped"] for r in per_rank) / (config["iters"] * len(per_rank)),
            "identical": len({r["sha"] for r in per_rank}) == 1,
            "staleness": per_rank[0]["staleness"], "scale": per_rank[0]["scale"],
            "sizes": per_rank[0]["sizes"], "curve": per_rank[0]["curve"],
            "waited": statistics.median(r["waited_s"] / r["loop_s"] for r in per_rank[:-1])})
    for (problem, mode, scaling), got in runs.items():
        sync = runs[(problem, "sync", "plain")]
        ref = statistics.median(r["metric"] for r in sync)
        # Synchronous's final metric minus 1 point (a loss: plus 10%), reached by rank 0.
        target = ref - 0.01 if problem in CLASSES else ref * 1.1
        sooner = _sooner(sync, got, target, problem in CLASSES)
        ref_s = statistics.median(r["fast_s"] for r in sync)
        ref_all = statistics.median(r["all_s"] for r in sync)
        values = [r["metric"] for r in got]
        mid = statistics.median(values)
        if problem in CLASSES:
            diverged = sum(v < 1.5 / CLASSES[problem] for v in values)
            versus = f"{100 * (mid - ref):+.1f} pt"
        else:
            diverged = sum(not math.isfinite(v) or v > 10 * ref for v in values)
            versus = f"{mid / ref:.3g}x"
        fast = statistics.median(r["fast_s"] for r in got) / ref_s
        slowest = statistics.median(r["all_s"] for r in got) / ref_all
        rows.append({"problem": problem, "mode": mode, "scaling": scaling, "metric": values,
                     "median": mid, "versus_sync": versus, "diverged": diverged,
                     "fast_s_ratio": fast, "all_s_ratio": slowest,
                     "steps_per_iter": statistics.median(r["steps"] for r in got),
                     "dropped": statistics.median(r["dropped"] for r in got),
                     "staleness": statistics.median(r["staleness"] for r in got),
                     "scale": statistics.median(r["scale"] for r in got),
                     "sizes": statistics.median(r["sizes"] for r in got),
                     "waited": statistics.median(r["waited"] for r in got),
                     "sooner": sooner, "curves": [r["curve"] for r in got],
                     "identical": all(r["identical"] for r in got)})
        table.append([problem, mode, scaling if mode != "sync" else "-",
                      " ".join(f"{v:.4g}" for v in values), f"{mid:.4g}", versus,
                      f"{diverged}/{len(values)}", f"{rows[-1]['steps_per_iter']:.2f}",
                      f"{100 * rows[-1]['dropped']:.0f}%", f"{rows[-1]['sizes']:.2f}",
                      f"{rows[-1]['staleness']:.2f}", f"{rows[-1]['scale']:.2f}",
                      f"{fast:.2f}", f"{slowest:.2f}",
                      f"{100 * rows[-1]['waited']:.0f}%", sooner or "-",
                      "yes" if rows[-1]["identical"] else "NO"])
    return format_table(["problem", "mode", "scaling[@timeout]", "metric per run", "median",
                         "vs sync", "diverged", "steps/iter", "dropped", "grads/step",
                         "staleness", "scale", "fast s / sync", "all s / sync",
                         "fast waited", "x sooner to target", "replicas equal"],
                        table), rows


def _reached(curve: list, target: float, higher: bool) -> float | None:
    """Seconds to the first snapshot at or past ``target`` (None: never)."""
    return next((t for t, v in curve if (v >= target if higher else v <= target)), None)


def _sooner(sync: list[dict], got: list[dict], target: float, higher: bool) -> str:
    """How many times sooner than Synchronous (median of its runs) each run of ``got``
    reached ``target``, as text ("" without snapshots)."""
    if not sync[0]["curve"]:
        return ""
    ref = [t for t in (_reached(r["curve"], target, higher) for r in sync) if t is not None]
    if not ref:
        return "sync never"
    ref_t = statistics.median(ref)
    times = [_reached(r["curve"], target, higher) for r in got]
    return " ".join("never" if t is None else f"{ref_t / t:.2f}" for t in times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--problems", nargs="+", choices=["regression", "spirals", "cnn"],
                        default=["regression", "spirals", "cnn"])
    parser.add_argument("--modes", nargs="*", choices=["bounded", "async", "quorum"],
                        default=["bounded", "async", "quorum"],
                        help="besides Synchronous, which is always run")
    parser.add_argument("--scalings", nargs="+", choices=SCALINGS, default=list(SCALINGS))
    parser.add_argument("--stale-timeouts", nargs="+", default=["adaptive"],
                        help="BoundedStaleness' and Asynchronous' timeouts: seconds (0: the "
                        "rule before the wait for one's own step), or adaptive")
    parser.add_argument("--quorum-timeouts", nargs="+", default=["adaptive", "0"],
                        help="Quorum(min_ranks=n-1)'s timeouts: seconds, or adaptive; "
                        "TIMEOUT/SCALING also sets its step scaling (e.g. adaptive/plain)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--slowdown", type=float, default=3.0,
                        help="the last rank sleeps this many times as long (1: no straggler)")
    parser.add_argument("--step-seconds", type=float, default=0.01)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--lr-regression", type=float, default=0.05)
    parser.add_argument("--lr-spirals", type=float, default=0.05)
    parser.add_argument("--iters-regression", type=int, default=60)
    parser.add_argument("--iters-spirals", type=int, default=300)
    parser.add_argument("--lr-cnn", type=float, default=0.05)  # Synchronous's best
    parser.add_argument("--iters-cnn", type=int, default=300)
    parser.add_argument("--schedule", choices=["constant", "cosine"], default="constant",
                        help="the learning rate over a run (cosine: to 0 at its end)")
    parser.add_argument("--snap-every", type=int, default=0,
                        help="rank 0 keeps its parameters every N iterations (0: never), "
                        "evaluated after its loop: the time to Synchronous's final metric "
                        "minus 1 point (a loss: plus 10%%)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds in all")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    args.lr = {"regression": args.lr_regression, "spirals": args.lr_spirals,
               "cnn": args.lr_cnn}
    args.iters = {"regression": args.iters_regression, "spirals": args.iters_spirals,
                  "cnn": args.iters_cnn}
    configs = configurations(args)
    started = time.monotonic()
    with CoordinatorProcess(shards=0) as hub:
        results = run_ranks(rank_main, args.ranks, (hub.address, configs),
                            timeout=args.timeout, label="sync_stability")
    text, rows = report(configs, results, args.ranks)
    print(f"{args.ranks} ranks on one host, the last {args.slowdown:g}x slow "
          f"({args.step_seconds * 1000:g} ms a step, sleeping); SGD momentum 0.9, lr "
          f"{args.lr}, iterations {args.iters}; BoundedStaleness({args.max_staleness}); "
          f"{args.seeds} seeds; {time.monotonic() - started:.0f} s; load {loadavg()}")
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                  if k != "json"}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
