"""DataParallel's step against the plain module's, in one process, and what replication costs.

What is measured
    An MLP of ``--depth`` Linear+ReLU layers of width ``--width`` (float32) trained with SGD on
    batches of ``--batch`` rows, two ways in the same process, step by step in alternating
    order (so both see the same background load; this machine may be shared):

    * plain: the module on the first device, the whole batch;
    * data_parallel: ``gradstar.DataParallel(module, device_ids=DEVICES)`` on an identical copy
      (same seed), the same batches.

    Each runs ``--warmup`` untimed steps, then ``--iters`` timed steps of ``zero_grad();
    forward; loss.backward(); opt.step()`` (CUDA synchronized before the clock is read). The
    table shows the median step time, its ratio to plain, and, timed apart, the median time of
    ``replicate()`` alone (the per-forward copies of every parameter to the other replicas:
    ``(replicas - 1) x`` the model's bytes each step).

    Correctness is checked, not assumed: after the steps the largest difference between the two
    models' parameters is printed (float32 rounding only) and a difference over 1e-4 fails.

How to reproduce
    .venv/bin/python benchmarks/data_parallel.py                      # every GPU, or cpu,cpu
    .venv/bin/python benchmarks/data_parallel.py --devices cuda:0,cuda:1 --width 4096 --json o
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import MiB, add_run_arguments, environment, format_table, median, write_json


def make_model(width: int, depth: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def timed(step, devices) -> float:
    import torch

    started = time.perf_counter()
    step()
    for device in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def main() -> int:
    import torch
    from torch import nn

    import gradstar
    from gradstar.client.data_parallel import replicate
    from gradstar.client.data_parallel.devices import resolve_devices

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", help="comma-separated; default every GPU, or cpu,cpu")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    add_run_arguments(parser)
    args = parser.parse_args()
    names = args.devices.split(",") if args.devices else (
        None if torch.cuda.is_available() else ["cpu", "cpu"])
    devices = resolve_devices(names)
    plain = make_model(args.width, args.depth).to(devices[0])
    wrapped = copy.deepcopy(plain)
    model = gradstar.DataParallel(wrapped, device_ids=devices)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(args.batch, args.width, generator=g),
             torch.randn(args.batch, args.width, generator=g))
            for _ in range(args.warmup + args.iters)]
    runs = {"plain": (plain, torch.optim.SGD(plain.parameters(), lr=1e-3)),
            "data_parallel": (model, torch.optim.SGD(model.parameters(), lr=1e-3))}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i, (x, y) in enumerate(data):
        for name, (net, opt) in runs.items():
            def step(net=net, opt=opt, x=x, y=y):
                opt.zero_grad()
                out = net(x.to(devices[0]))
                nn.functional.mse_loss(out, y.to(out.device)).backward()
                opt.step()
            seconds = timed(step, devices)
            if i >= args.warmup:
                times[name].append(seconds)
    with torch.no_grad():
        copies = [timed(lambda: replicate(wrapped, devices[1:]), devices)
                  for _ in range(args.iters)]
        diff = max(float((p - q).abs().max()) for p, q in
                   zip(plain.parameters(), wrapped.parameters(), strict=True))
    model_mib = sum(p.numel() * p.element_size() for p in plain.parameters()) / MiB
    base = median(times["plain"])
    rows = [[name, f"{median(t) * 1e3:.2f}", f"{median(t) / base:.2f}x"]
            for name, t in times.items()]
    rows.append([f"replicate() to {len(devices) - 1} device(s)",
                 f"{median(copies) * 1e3:.2f}", f"{median(copies) / base:.2f}x"])
    print(f"DataParallel on {', '.join(map(str, devices))}: MLP {args.depth} x {args.width} "
          f"({model_mib:.1f} MiB of parameters), batch {args.batch}, {args.iters} steps")
    print(format_table(["", "median ms", "vs plain step"], rows))
    print(f"largest parameter difference after {len(data)} steps: {diff:.2e}")
    if args.json:
        write_json(args, "data_parallel", environment=environment(),
                   devices=[str(d) for d in devices], times=times, replicate=copies,
                   max_param_diff=diff, model_mib=model_mib)
    if diff > 1e-4:
        print("FAILED: DataParallel's parameters differ from the plain module's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
