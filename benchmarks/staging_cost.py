"""What staging a tiny CUDA tensor costs, piece by piece, in one process (no collective).

How to reproduce (a machine with a CUDA device)
    python benchmarks/staging_cost.py --numel 25 --calls 2000

Each row runs its piece ``--calls`` times after 50 untimed ones, with ``torch.cuda.synchronize()``
before and after the timed loop, and prints the wall time and the process's CPU time per call
in microseconds. The pieces are torch's own operations (``t.cpu()``, pinned and pageable copies,
stream look-ups and switches, allocations) and gradstar's staging functions
(:mod:`gradstar.client.device`, :func:`gradstar.client.convert.to_numpy` with its restore):
their sum against a collective's time tells how much of a tiny CUDA collective is staging.
Without CUDA it exits 2 saying so. Not asserted: any timing.
"""

from __future__ import annotations

import argparse
import sys
import time
import weakref


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25, help="float32 elements (default 25)")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("staging_cost.py: no CUDA device (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    from gradstar.client import device as staging
    from gradstar.client.convert import to_numpy

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    t = torch.full((args.numel,), 1.0, device=dev)
    pinned = torch.empty(args.numel, pin_memory=True)
    pageable = torch.empty(args.numel)
    on_dev = torch.empty(args.numel, device=dev)
    stream = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)

    def round_trip():
        arr, restore = to_numpy(t)
        restore(arr)

    def event_wait():
        e = torch.cuda.Event()
        e.record(stream)
        e.synchronize()

    def future():
        f = torch.futures.Future(devices=[dev])
        f.set_result(None)
        f.wait()

    def stream_switch():
        with torch.cuda.stream(side):
            pass

    def device_ctx():
        with torch.cuda.device(dev):
            pass

    pieces = [
        ("t.cpu()", lambda: t.cpu()),
        ("current_stream(dev)", lambda: torch.cuda.current_stream(dev)),
        ("current_stream(dev).synchronize()", lambda: torch.cuda.current_stream(dev).synchronize()),
        ("torch.cuda.synchronize()", torch.cuda.synchronize),
        ("event record + synchronize", event_wait),
        ("empty(pin_memory=True)", lambda: torch.empty(args.numel, pin_memory=True)),
        ("empty(device=cuda)", lambda: torch.empty(args.numel, device=dev)),
        ("pinned.copy_(t)  (D2H, waits)", lambda: pinned.copy_(t)),
        ("pageable.copy_(t)  (D2H, waits)", lambda: pageable.copy_(t)),
        ("on_dev.copy_(pageable) + sync", lambda: (on_dev.copy_(pageable), stream.synchronize())),
        ("on_dev.copy_(pinned, non_blocking) + sync",
         lambda: (on_dev.copy_(pinned, non_blocking=True), stream.synchronize())),
        ("on_dev.copy_(t) (D2D) + sync", lambda: (on_dev.copy_(t), stream.synchronize())),
        ("with torch.cuda.stream(other)", stream_switch),
        ("with torch.cuda.device(dev)", device_ctx),
        ("Future(devices=[dev]) set + wait", future),
        ("weakref.finalize", lambda: weakref.finalize(pinned, int)),
        ("gradstar to_host_array(t)", lambda: staging.to_host_array(t)),
        ("gradstar to_device(pageable, dev, stream)",
         lambda: staging.to_device(pageable, dev, stream=stream)),
        ("gradstar to_numpy(t) + restore (round trip)", round_trip),
    ]
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
          f"{args.numel} float32, {args.calls} calls; us per call")
    print(f"{'piece':48s} {'wall':>8s} {'cpu':>8s}")
    for name, fn in pieces:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - w0) / args.calls * 1e6
        cpu = (time.process_time() - c0) / args.calls * 1e6
        print(f"{name:48s} {wall:8.1f} {cpu:8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
