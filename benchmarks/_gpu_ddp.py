"""Part 2 of ``gpu.py``, the driver side: a DDP step per configuration (local, gloo, backend
"gradstar", gradstar.DDP) for each world size, every configuration's final parameters checked
against gloo's (:class:`ParameterCheck`), and the table."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _gpu_ranks import ddp_rank, mlp_widths
from _processes import BenchmarkError, free_port
from _ranks import run_ranks
from _report import fmt, format_table, median, run_configs
from ddp_step import run_on_hub

DDP_TIMEOUT = 600.0


class ParameterCheck:
    """``run_configs``' check of a DDP configuration: its ranks end with identical parameters
    (digests), and a gradstar configuration's equal gloo's (run first) within ``atol + rtol *
    |gloo's|``. Keeps the figures for the table in ``found``."""

    def __init__(self, atol: float, rtol: float) -> None:
        self.atol = atol
        self.rtol = rtol
        self.reference = None  # gloo's rank 0 parameters
        self.found: dict[str, dict] = {}

    def __call__(self, results: list[dict], name: str) -> None:
        first = results[0]
        for rank, r in enumerate(results[1:], start=1):
            if r["digest"] != first["digest"]:
                worst = max(abs(a - b) for a, b in zip(first["sample"], r["sample"], strict=True))
                raise BenchmarkError(f"[ddp {name}] rank {rank}'s parameters differ from rank "
                                     f"0's (max abs diff in a sample {worst:g}): the replicas "
                                     "diverged")
        params = self.load(first)
        if name == "gloo":
            self.reference = params
            return
        found = self.found[name] = self.compare(params)
        if found["over_tolerance"]:
            j = found["worst_over_index"]
            raise BenchmarkError(
                f"[ddp {name}] parameters differ from gloo's beyond float32 rounding: "
                f"{found['over_tolerance']} of {params.size} exceed atol {self.atol:g} + rtol "
                f"{self.rtol:g} x |gloo|; worst at index {j}: {float(params[j])!r} vs gloo "
                f"{float(self.reference[j])!r}; max abs diff {found['max_abs_diff']:.3g} "
                f"(median step {median(first['times']) * 1e3:.1f} ms)")

    @staticmethod
    def load(rank0: dict):
        """Rank 0's saved final parameters (the file is removed)."""
        import numpy as np

        params = np.load(rank0["saved"])
        Path(rank0["saved"]).unlink(missing_ok=True)
        return params

    def compare(self, params) -> dict:
        """How ``params`` differ from gloo's: max |diff|, how many exceed the tolerance."""
        import numpy as np

        if self.reference is None:
            return {"max_abs_diff": None, "over_tolerance": None, "within_tolerance": None}
        ref = self.reference.astype(np.float64)
        diff = np.abs(params.astype(np.float64) - ref)
        excess = diff - (self.atol + self.rtol * np.abs(ref))
        i, j = int(np.argmax(diff)), int(np.argmax(excess))
        over = int(np.count_nonzero(excess > 0))
        return {"max_abs_diff": float(diff[i]), "worst_index": i, "over_tolerance": over,
                "worst_over_index": j if over else None, "within_tolerance": not over}


def run_part_ddp(args, failures: list) -> list[dict]:
    rows = []
    for ranks in args.ranks:
        with tempfile.TemporaryDirectory(prefix="gradstar-bench-gpu-") as folder:
            rows += run_ddp_configs(args, ranks, Path(folder), failures)
    return rows


def run_ddp_configs(args, ranks: int, folder: Path, failures: list) -> list[dict]:
    """Part 2 for one world size: local, gloo, then the gradstar configurations; rank 0 of
    each saves its final parameters under ``folder`` for :class:`ParameterCheck`."""
    widths = mlp_widths(args.model_mparams)
    timeout = args.timeout or DDP_TIMEOUT
    common = (args.device, widths, args.batch, args.warmup_steps, args.steps,
              args.bucket_cap_mb, args.lr)
    check = ParameterCheck(args.atol, args.rtol)

    def save_as(name: str) -> str:
        return str(folder / (name.replace(" ", "-").replace(".", "-") + ".npy"))

    def saved(results: list[dict], name: str) -> list[dict]:
        results[0]["saved"] = save_as(name)
        return results

    def local_run():
        return run_ranks(ddp_rank, ranks, (None, None, "local", *common, save_as("local")),
                         timeout=timeout, label=f"ddp local ranks={ranks}")

    def gloo_run():
        return saved(run_ranks(ddp_rank, ranks, (f"tcp://127.0.0.1:{free_port()}", None,
                                                 "gloo", *common, save_as("gloo")),
                               timeout=timeout, label=f"ddp gloo ranks={ranks}"), "gloo")

    def hub_run(api: str, path: str, name: str):
        return lambda: saved(run_on_hub(ddp_rank, ranks, (api, *common, save_as(name)),
                                        shards=args.shards, path=path, timeout=timeout,
                                        label=f"ddp {name} ranks={ranks}"), name)

    configs = [("local", local_run)]
    if "gloo" in args.backends:
        configs.append(("gloo", gloo_run))
    for api, title in (("torch", "gradstar torch"), ("sdk", "gradstar.DDP")):
        if api in args.backends:
            configs += [(f"{title} {path}", hub_run(api, path, f"{title} {path}"))
                        for path in args.paths]
    print(f"  DDP step, {ranks} ranks:", file=sys.stderr, flush=True)
    runs, failed = run_configs(configs, check)
    if runs.get("local"):
        # No communication, so local's parameters must differ from gloo's: how much says
        # whether the tolerance could catch a gradient that was not averaged.
        check.found["local"] = check.compare(check.load(saved(runs["local"], "local")[0]))
    failures += [(f"ddp {name} ranks={ranks}", error) for name, error in failed]
    gloo = runs.get("gloo")
    gloo_ms = median(gloo[0]["times"]) * 1e3 if gloo else None
    rows = []
    for name, results in runs.items():
        row = {"ranks": ranks, "backend": name, "error": dict(failed).get(name)}
        if results is not None:
            ms = median(results[0]["times"]) * 1e3
            row |= {"median_ms": ms, "ratio": ms / gloo_ms if gloo_ms else None,
                    "rank0_times_ms": [round(t * 1e3, 3) for t in results[0]["times"]],
                    "median_ms_by_rank": [round(median(r["times"]) * 1e3, 3) for r in results],
                    "params": results[0]["params"], "devices": [r["device"] for r in results],
                    "moved": results[0].get("moved")}
        rows.append(row | check.found.get(name, {}))
    return rows


def ddp_table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        diff = fmt(r.get("max_abs_diff"), ".1e")
        over = r.get("over_tolerance")
        if r["backend"] == "local":
            verdict = "-" if over is None else f"n/a, {over} over"
        else:
            verdict = "-" if over is None else ("yes" if not over else f"NO, {over} over")
        if r["error"]:
            lines.append([r["ranks"], r["backend"], "FAILED", "-", diff, verdict])
            continue
        lines.append([r["ranks"], r["backend"], f"{r['median_ms']:.1f}", fmt(r["ratio"], ".2f"),
                      diff, verdict])
    return format_table(["ranks", "backend", "ms/step", "ratio vs gloo", "max |p - p_gloo|",
                         "within tolerance"], lines)


__all__ = ["DDP_TIMEOUT", "ParameterCheck", "ddp_table", "run_part_ddp"]
