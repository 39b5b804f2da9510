"""Wire formats: the error of one all_reduce per format, against gloo with torch's compress
hooks, and what encoding and decoding cost in CPU seconds per GB.

What is measured
    * ``--blocks``: the relative L2 error of one round trip through int8 and int4 for block
      sizes 16..256, on 4M float32 elements drawn from a standard Gaussian and from a Student-t
      with 3 degrees of freedom (heavy tails, like gradients), next to the bits a float32
      scale costs per element. The block size in ``gradstar/wire/formats.py`` was chosen
      from this table.
    * ``--error`` (the default): one ``all_reduce(x, "mean")`` over ``--ranks`` (8) spawned
      rank processes of Gaussian float32 data (``--elements`` per rank, a seed per rank), with
      ``wire=`` each format and without one, through a real ``gradstar coordinator --shards 0``
      subprocess with payloads on the gRPC stream (GRADSTAR_SHARED_MEMORY=0, as between
      hosts); and the same data through ``torch.distributed`` gloo in as many processes: float32,
      and torch's ``bf16_compress_hook`` / ``fp16_compress_hook`` semantics (divide by the world
      size, cast, all_reduce(sum) of the half-precision tensor, which gloo's ring adds in that
      precision at every hop, cast back to float32). The error is ||result - ref||_2 / ||ref||_2
      against the float64 mean, on rank 0's result; every rank's result must be bit-identical
      to rank 0's (the run fails otherwise). The run fails unless gradstar bf16 is strictly
      below gloo + bf16 hook.
    * ``--speed``: CPU seconds (``time.process_time``, this process, one thread) per GB of
      float32 payload (1 GB = 1e9 bytes) for each format, on chunks of 2 MiB (the client's
      default chunk): on a rank, encoding its input and decoding its result; on the hub, for
      ``--ranks`` contributions of a chunk, decoding each into the float32 accumulator and
      encoding the result once, per GB of contributions (float32: the plain np.add of the hub).
      Each figure is the best of 5 trials of ``--reps`` calls.

How to reproduce
    .venv/bin/python benchmarks/wire_error.py --blocks
    .venv/bin/python benchmarks/wire_error.py                     # --error, 8 ranks, 1M elements
    .venv/bin/python benchmarks/wire_error.py --speed
    .venv/bin/python benchmarks/wire_error.py --error --speed --blocks --json /tmp/wire.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _processes import BenchmarkError, CoordinatorProcess, free_port
from _ranks import run_ranks
from _report import environment, format_table

from gradstar.wire.formats import FORMATS as WIRE_FORMATS

FORMATS = tuple(WIRE_FORMATS)
CHUNK_ELEMENTS = 1 << 19  # 2 MiB of float32, the client's default chunk


def data(rank: int, elements: int) -> np.ndarray:
    return np.random.default_rng(1000 + rank).standard_normal(elements).astype(np.float32)


def rel_l2(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - ref) / np.linalg.norm(ref))


# -- rank bodies (spawned processes) -----------------------------------------------------------


def gradstar_rank(rank: int, world_size: int, address: str, job: str, elements: int) -> dict:
    import hashlib

    import gradstar

    x = data(rank, elements)
    pg = gradstar.init_process_group(coordinator=address, job=job, world_size=world_size,
                                     rank=rank, timeout=300)
    out = {}
    try:
        for wire in (None, *FORMATS):
            result = pg.all_reduce(x, "mean", wire=wire)
            out[wire or "float32"] = (hashlib.sha256(result.tobytes()).hexdigest(),
                                      result if rank == 0 else None)
    finally:
        pg.close()
    return out


def gloo_rank(rank: int, world_size: int, init_method: str, elements: int) -> dict:
    import hashlib

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    x = torch.from_numpy(data(rank, elements))
    out = {}
    try:
        for name, dtype in (("float32", torch.float32), ("bf16 hook", torch.bfloat16),
                            ("fp16 hook", torch.float16)):
            # torch's bf16_compress_hook / fp16_compress_hook: divide, cast, sum, cast back.
            t = (x / world_size).to(dtype)
            dist.all_reduce(t)
            result = t.to(torch.float32).numpy()
            out[name] = (hashlib.sha256(result.tobytes()).hexdigest(),
                         result if rank == 0 else None)
    finally:
        dist.destroy_process_group()
    return out


def _collect(results: list[dict], backend: str) -> dict[str, np.ndarray]:
    """Rank 0's result per format, after checking every rank got the same bytes."""
    chosen = {}
    for name, (digest, array) in results[0].items():
        differ = [r for r, res in enumerate(results) if res[name][0] != digest]
        if differ:
            raise BenchmarkError(f"{backend} {name}: ranks {differ} got another result than "
                                 "rank 0")
        chosen[name] = array
    return chosen


def error_table(ranks: int, elements: int, timeout: float) -> tuple[str, list[dict]]:
    from gradstar.wire.formats import bits_per_element

    ref = np.mean([data(r, elements).astype(np.float64) for r in range(ranks)], axis=0)
    with CoordinatorProcess(shards=0, env={"GRADSTAR_SHARED_MEMORY": "0"}) as coord:
        ours = _collect(run_ranks(gradstar_rank, ranks, (coord.address, f"wire-{uuid.uuid4()}",
                                                         elements), timeout=timeout,
                                  label="gradstar", env={"GRADSTAR_SHARED_MEMORY": "0"}),
                        "gradstar")
    gloo = _collect(run_ranks(gloo_rank, ranks, (f"tcp://127.0.0.1:{free_port()}", elements),
                              timeout=timeout, label="gloo"), "gloo")
    rows = [{"backend": "gradstar", "format": name, "bits": 32.0 if name == "float32"
             else bits_per_element(name), "rel_l2": rel_l2(ours[name], ref)} for name in ours]
    rows += [{"backend": "gloo", "format": name, "bits": 32.0 if name == "float32" else 16.0,
              "rel_l2": rel_l2(gloo[name], ref)} for name in gloo]
    ours_bf16 = next(r["rel_l2"] for r in rows if r["format"] == "bf16")
    hook = next(r["rel_l2"] for r in rows if r["format"] == "bf16 hook")
    if not ours_bf16 < hook:
        raise BenchmarkError(f"gradstar bf16 error {ours_bf16:.3e} is not below gloo + bf16 "
                             f"hook's {hook:.3e}")
    table = format_table(
        ["backend", "wire", "bits/elem", "rel L2 error", "x gradstar bf16"],
        [[r["backend"], r["format"], f"{r['bits']:.2f}", f"{r['rel_l2']:.3e}",
          f"{r['rel_l2'] / ours_bf16:.2f}"] for r in rows])
    return (f"one all_reduce(mean) of {elements} Gaussian float32 elements over {ranks} ranks, "
            f"relative L2 error against float64\n{table}"), rows


def blocks_table() -> tuple[str, list[dict]]:
    from gradstar.wire.formats import FORMATS as CODECS
    from gradstar.wire.formats import roundtrip

    rng = np.random.default_rng(0)
    gauss = rng.standard_normal(1 << 22).astype(np.float32)
    heavy = rng.standard_t(3, 1 << 22).astype(np.float32)
    rows = []
    for block in (16, 32, 64, 128, 256):
        row = {"block": block, "scale_bits": 32 / block}
        for name in ("int8", "int4"):
            fmt = dataclasses.replace(CODECS[name], block=block)
            for label, x in (("gauss", gauss), ("t3", heavy)):
                row[f"{name}_{label}"] = rel_l2(roundtrip(fmt, x), x.astype(np.float64))
        rows.append(row)
    table = format_table(
        ["block", "int8 gauss", "int8 t(3)", "int4 gauss", "int4 t(3)", "scale bits/elem"],
        [[r["block"], f"{r['int8_gauss']:.4f}", f"{r['int8_t3']:.4f}", f"{r['int4_gauss']:.4f}",
          f"{r['int4_t3']:.4f}", f"{r['scale_bits']:.3f}"] for r in rows])
    return f"round-trip relative L2 error by block size (4M elements)\n{table}", rows


def _cpu(fn, reps: int, trials: int = 5) -> float:
    """CPU seconds of one ``fn()``: the best of ``trials`` means over ``reps`` calls (the
    machine's other load only ever adds time)."""
    best = float("inf")
    for _ in range(trials):
        start = time.process_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.process_time() - start) / reps)
    return best


def speed_table(ranks: int, reps: int) -> tuple[str, list[dict]]:
    from gradstar.wire.formats import FORMATS as CODECS
    from gradstar.wire.formats import decode_into, encode_into

    x = data(0, CHUNK_ELEMENTS)
    gb = x.nbytes / 1e9
    acc = np.zeros_like(x)
    scratch = np.empty_like(x)
    rows = [{"format": "float32", "rank_encode": 0.0, "rank_decode": 0.0,
             "hub": _cpu(lambda: np.add(acc, x, out=acc), reps) / gb}]
    for name in FORMATS:
        fmt = CODECS[name]
        buf = np.empty(fmt.encoded_nbytes(x.size), np.uint8)
        encode = _cpu(lambda fmt=fmt, buf=buf: encode_into(fmt, x, buf), reps)
        decode = _cpu(lambda fmt=fmt, buf=buf: decode_into(fmt, buf, acc), reps)
        fold = _cpu(lambda fmt=fmt, buf=buf: decode_into(fmt, buf, acc, accumulate=True,
                                                         scratch=scratch), reps)
        rows.append({"format": name, "rank_encode": encode / gb, "rank_decode": decode / gb,
                     "hub": (ranks * fold + encode) / (ranks * gb)})
    table = format_table(
        ["wire", "rank encode s/GB", "rank decode s/GB", "rank total s/GB",
         f"hub s/GB ({ranks} ranks)"],
        [[r["format"], f"{r['rank_encode']:.3f}", f"{r['rank_decode']:.3f}",
          f"{r['rank_encode'] + r['rank_decode']:.3f}", f"{r['hub']:.3f}"] for r in rows])
    return (f"CPU seconds per GB of float32 payload, 2 MiB chunks, one thread\n{table}\n"
            "(rank: its input encoded and its result decoded, each per GB of its tensor; hub: "
            "each rank's chunk decoded into the float32 accumulator and the result encoded once, "
            "per GB of contributions)"), rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--error", action="store_true", help="the all_reduce error table")
    parser.add_argument("--blocks", action="store_true", help="the block-size table")
    parser.add_argument("--speed", action="store_true", help="the CPU-seconds-per-GB table")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--elements", type=int, default=1 << 20)
    parser.add_argument("--reps", type=int, default=10,
                        help="calls per trial for --speed (5 trials)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, help="write every table's rows here")
    args = parser.parse_args(argv)
    if not (args.error or args.blocks or args.speed):
        args.error = True
    report = {"environment": environment()}
    for wanted, key, run in ((args.blocks, "blocks", blocks_table),
                             (args.error, "error",
                              lambda: error_table(args.ranks, args.elements, args.timeout)),
                             (args.speed, "speed", lambda: speed_table(args.ranks, args.reps))):
        if wanted:
            text, rows = run()
            print(text, end="\n\n", flush=True)
            report[key] = rows
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
