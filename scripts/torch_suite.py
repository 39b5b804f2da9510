"""Run PyTorch's own distributed test suite against backend "gradstar" next to "gloo".

What runs
    ``torch/testing/_internal/distributed/distributed_test.py`` (it ships in the torch wheel; it
    is the suite behind upstream's ``test/distributed/test_distributed_spawn.py``): every test of
    ``DistributedTest._DistTestBase``, as upstream runs it, through a ``TestDistBackend``
    subclass: each test in fresh rank processes that ``init_process_group`` from a ``file://``
    store, run the test, and ``destroy_process_group``. Each test runs under each backend in
    turn (gloo, then gradstar), at each world size (default 2 and 3; one suite process per world
    size, since the module reads WORLD_SIZE when it is imported).

How gradstar takes gloo's place
    The module reads the environment variable BACKEND when it is imported and gates tests on it
    (``BACKEND != "gloo"`` skips the timeout, sparse and batch-p2p tests, for instance). gradstar
    claims gloo's CPU feature set, so the module is imported with ``BACKEND=gloo`` (gradstar is
    offered every test gloo is offered) and its ``BACKEND`` global is then set to the backend under
    test, which is what every ``init_process_group`` and ``new_group`` of the suite reads. The
    profiling allow-lists (``PROFILING_SUPPORTED_BACKENDS`` and the send/recv one) get "gradstar"
    too, so the suite checks gradstar's profiler events as it checks gloo's. That global is a
    :class:`GlooStandIn`: the string "gradstar" (what torch gets, and what ``dist.get_backend()``
    is compared with), which also equals "gloo", so that tests that branch on
    ``BACKEND == "gloo"`` at run time take gloo's CPU path, as their gates did at import.

    The coordinator (``--hub``): ``shared`` (the default) starts one ``gradstar coordinator`` for
    the whole run, as a deployment runs one, and gives each test a job of its own
    (``GRADSTAR_COORDINATOR``, ``GRADSTAR_JOB``); ``store`` configures none, so rank 0 of each
    test starts one through torch's store, as under torchrun (see
    ``gradstar.client.torch_backend.store_hub``), which adds a Python start-up to every test.

Output
    A table of test families (the test name up to its variant: ``all_reduce``, ``broadcast``,
    ``ddp``, ...) with, per world size and backend, passed/run (skipped tests are not counted),
    then every test gloo passes and gradstar fails, with the first line of gradstar's error,
    and the wall time of each backend's runs. Exit status 1 if gradstar fails a test gloo passes
    other than by torch's own refusal of every backend but gloo (:data:`GLOO_ONLY`).

How to reproduce
    make torch-suite                            # everything, 2 and 3 ranks (~10 min, 2 cores)
    .venv/bin/python scripts/torch_suite.py -k all_reduce -k barrier --world-sizes 2
    .venv/bin/python scripts/torch_suite.py --tests test_broadcast test_barrier --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import unittest
import uuid
from collections import defaultdict
from pathlib import Path

BACKENDS = ("gloo", "gradstar")
#: Set in the suite processes (and inherited by their rank processes): the backend under test.
BACKEND_VAR = "GRADSTAR_TORCH_SUITE_BACKEND"
#: Tests gloo passes that gradstar cannot, by torch's own design rather than gradstar's: the
#: family, the error that says so, and why.
GLOO_ONLY = {
    "monitored_barrier": (
        "monitored_barrier is only implemented for GLOO backend",
        "gloo-only by torch's own check: torch.distributed.monitored_barrier refuses every "
        "other backend before it reaches the group (gradstar's group has monitored_barrier, "
        "which the test that calls it on the group passes)"),
}


def gloo_only(test: str, error: str) -> bool:
    """Whether ``test`` failed with torch's own refusal of every backend but gloo."""
    known = GLOO_ONLY.get(family(test))
    return known is not None and known[0] in error
#: Test families: a test belongs to the longest of these its name (after ``test_``) starts
#: with, else to its first word.
FAMILIES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_coalesced",
    "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "scatter", "scatter_object_list", "barrier", "barrier_timeout",
    "monitored_barrier", "send_recv", "send_recv_any_source", "send_recv_nccl",
    "batch_isend_irecv", "isend", "irecv", "new_subgroups", "get", "destroy", "sparse",
    "ddp", "DistributedDataParallel", "DistributedSampler", "SyncBatchNorm", "nccl",
    "post_localSGD", "periodic_model_averager", "average_parameters", "accumulate_gradients",
    "allgather", "compute_bucket_assignment", "coalescing_manager", "output_unused",
    "undefined_grad", "verify_model_across_rank", "static_graph", "detect_ddp",
    "stateless_api", "invalid_static_graph", "3_level", "1_level", "grads_same",
    "different_graph", "skip_all_reduce", "sync_bn",
)


def family(test: str) -> str:
    """The family of ``test`` (see :data:`FAMILIES`)."""
    name = test.removeprefix("test_")
    matches = [f for f in FAMILIES if name == f or name.startswith(f + "_")]
    return max(matches, key=len) if matches else name.split("_")[0]


# -- the suite process: torch's tests, run one by one under each backend ----------------------

_suite = None  # torch's distributed_test module, once imported (suite processes only)


class GlooStandIn(str):
    """A backend name that also compares equal to "gloo" (see the module docstring)."""

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other) is True or str.__eq__("gloo", other) is True

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = str.__hash__


def _backend_global(backend: str) -> str:
    return backend if backend == "gloo" else GlooStandIn(backend)


def _import_suite():
    """Import torch's suite as gloo (its gates), then point it at the backend under test."""
    global _suite
    import torch.distributed as dist

    import gradstar.client.torch_backend  # noqa: F401  (registers backend "gradstar")

    os.environ["BACKEND"] = "gloo"
    # The file:// gates read INIT_METHOD at import; each test's setUp then makes a fresh one
    # (which a spawned rank process finds set, and keeps).
    os.environ.setdefault("INIT_METHOD", "file:///dev/null")
    from torch.testing._internal.distributed import distributed_test as suite

    for allowed in (suite.PROFILING_SUPPORTED_BACKENDS,
                    suite.SEND_RECV_PROFILING_SUPPORTED_BACKENDS):
        if dist.Backend("gradstar") not in allowed:
            allowed.append(dist.Backend("gradstar"))
    suite.BACKEND = _backend_global(os.environ[BACKEND_VAR])
    _suite = suite
    return suite


def _define_test_case(suite, start_method: str):
    import torch

    class TorchSuite(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        """torch's tests, each in ``world_size`` fresh rank processes (fork or spawn)."""

        def setUp(self) -> None:
            super().setUp()
            suite.INIT_METHOD = os.environ["INIT_METHOD"]  # this test's, for forked ranks
            if "GRADSTAR_COORDINATOR" in os.environ:  # --hub shared: a job per test
                os.environ["GRADSTAR_JOB"] = f"torch-suite-{uuid.uuid4().hex[:12]}"
            self._start_processes(torch.multiprocessing.get_context(start_method).Process)

    TorchSuite.__qualname__ = TorchSuite.__name__
    return TorchSuite


if BACKEND_VAR in os.environ:
    # A suite process, or (spawn) one of its rank processes re-importing this file: the test case
    # class must exist under the same name in both.
    TorchSuite = _define_test_case(_import_suite(), os.environ.get("GRADSTAR_TORCH_SUITE_START",
                                                                   "fork"))


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure|"
                             r"SkipTest)\b(: .*)?$")


def first_error_line(message: str) -> str:
    """The exception line of the first rank's traceback in a failed test's message (torch's
    parent process reports "Process R exited with error code 10 and exception: <traceback>")."""
    block = re.split(r"\nProcess \d+ exited with error code", message)[0]
    tail = block.rsplit("Traceback (most recent call last):", 1)[-1]
    for line in reversed(tail.splitlines()):
        if _EXCEPTION_LINE.match(line):
            return line[:300]
    lines = [line for line in message.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no message)"


class _Result(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.status, self.error = "pass", ""

    def addFailure(self, test, err) -> None:
        self.status, self.error = "fail", self._line(err)

    def addError(self, test, err) -> None:
        self.status, self.error = "fail", self._line(err)

    def addSkip(self, test, reason) -> None:
        self.status, self.error = "skip", str(reason)[:300]

    def addUnexpectedSuccess(self, test) -> None:
        self.status = "pass"

    @staticmethod
    def _line(err) -> str:
        return first_error_line("".join(traceback.format_exception(*err)))


def run_suite_process(args: argparse.Namespace) -> int:
    """Run each selected test under each backend; write {backend: {test: result}} as JSON."""
    results: dict[str, dict[str, dict]] = {b: {} for b in args.backends}
    for i, test in enumerate(args.tests):
        for backend in args.backends:
            os.environ[BACKEND_VAR] = backend  # spawned rank processes read it at import
            _suite.BACKEND = _backend_global(backend)  # forked ones inherit this
            result = _Result()
            t0 = time.monotonic()
            TorchSuite(test).run(result)
            seconds = time.monotonic() - t0
            results[backend][test] = {"status": result.status, "error": result.error,
                                      "seconds": round(seconds, 2)}
            print(f"[{args.world_size} ranks {i + 1}/{len(args.tests)}] {backend:8s} "
                  f"{result.status:4s} {seconds:6.1f} s {test}", file=sys.stderr, flush=True)
        args.out.write_text(json.dumps(results))  # as it goes: a killed run keeps what it did
    return 0


# -- the driver: one suite process per world size, then the table -----------------------------


def all_tests() -> list[str]:
    """Every test name of torch's suite (imported in a throwaway process: it needs the env)."""
    code = ("from torch.testing._internal.distributed.distributed_test import DistributedTest\n"
            "print('\\n'.join(n for n in dir(DistributedTest._DistTestBase) "
            "if n.startswith('test_')))")
    with tempfile.TemporaryDirectory() as temp:
        env = dict(_clean_env(), BACKEND="gloo", WORLD_SIZE="2", TEMP_DIR=temp)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=300, check=True)
    return out.stdout.split()


def _clean_env() -> dict[str, str]:
    """This environment without gradstar's or torch.distributed's settings."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("GRADSTAR_", "MASTER_", "TORCHELASTIC_"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "BACKEND",
                          "INIT_METHOD", "TEMP_DIR")}


@contextlib.contextmanager
def shared_hub(log: Path, timeout: float = 120.0):
    """A ``gradstar coordinator`` on 127.0.0.1 for the whole run (its log in ``log``); yields
    its address."""
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "gradstar", "coordinator", "--host", "127.0.0.1",
             "--port", "0", "--shards", "0", "--log-level", "WARNING"],
            env=_clean_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=log_file, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put("")],
                     daemon=True).start()
    try:
        while "listening on" not in (line := lines.get(timeout=timeout)):
            if not line:
                raise RuntimeError(f"the coordinator exited with {proc.wait(10)}: "
                                   f"{log.read_text()[-2000:]}")
        yield f"127.0.0.1:{line.rsplit(':', 1)[1].strip()}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def run_world(world_size: int, tests: list[str], args: argparse.Namespace, folder: Path,
              hub: str | None) -> dict[str, dict[str, dict]]:
    """One suite process at ``world_size``; its results (whatever it finished, if it was
    killed at ``--timeout``)."""
    out, log = folder / f"world{world_size}.json", folder / f"world{world_size}.log"
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as temp:
        env = dict(_clean_env(), WORLD_SIZE=str(world_size), TEMP_DIR=temp,
                   **({"GRADSTAR_COORDINATOR": hub} if hub else {}),
                   **{BACKEND_VAR: args.backends[0], "GRADSTAR_TORCH_SUITE_START": args.start,
                      # torch's own per-test bound: the parent kills a test's ranks after it.
                      "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(int(args.test_timeout))})
        command = [sys.executable, __file__, "--suite-process", "--world-sizes", str(world_size),
                   "--out", str(out), "--backends", *args.backends, "--tests", *tests]
        with open(log, "w") as log_file:
            # A session of its own, so that a run killed at its timeout takes its ranks along.
            proc = subprocess.Popen(command, env=env, stdout=log_file, stderr=log_file,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                proc.wait(args.timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                print(f"the {world_size}-rank run did not finish within {args.timeout:g} s "
                      f"(killed); its log: {log}", file=sys.stderr)
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text()[-3000:] if log.exists() else ""
        print(f"the {world_size}-rank suite process exited with {proc.returncode}:\n{tail}",
              file=sys.stderr)
    return json.loads(out.read_text()) if out.exists() else {b: {} for b in args.backends}


def table(results: dict[int, dict[str, dict[str, dict]]], backends: list[str]) -> str:
    """Markdown table: per family, passed/run for each world size and backend."""
    worlds = sorted(results)
    families: dict[str, list[str]] = defaultdict(list)
    for world in worlds:
        for test in results[world][backends[0]]:
            if test not in families[family(test)]:
                families[family(test)].append(test)
    headers = ["family", "tests"] + [f"{b} x{w}" for w in worlds for b in backends] + ["note"]
    rows = []
    for name in sorted(families, key=str.lower):
        row = [name, str(len(families[name]))]
        for world in worlds:
            for backend in backends:
                got = [results[world][backend].get(t, {}).get("status") for t in families[name]]
                ran = sum(s in ("pass", "fail") for s in got)
                row.append(f"{got.count('pass')}/{ran}" if ran else "skipped")
        row.append(GLOO_ONLY[name][1] if name in GLOO_ONLY else "")
        rows.append(row)
    totals = ["**all**", str(sum(len(t) for t in families.values()))]
    for world in worlds:
        for backend in backends:
            got = [r["status"] for r in results[world][backend].values()]
            totals.append(f"{got.count('pass')}/{got.count('pass') + got.count('fail')}")
    rows.append([*totals, ""])
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def regressions(results: dict[int, dict[str, dict[str, dict]]], reference: str,
                backend: str) -> list[tuple[int, str, str]]:
    """(world, test, first error line) for every test ``reference`` passes and ``backend``
    does not."""
    found = []
    for world in sorted(results):
        for test, ref in sorted(results[world].get(reference, {}).items()):
            got = results[world].get(backend, {}).get(test)
            if ref["status"] == "pass" and (got is None or got["status"] != "pass"):
                found.append((world, test, got["error"] if got else "(not run)"))
    return found


def report(results: dict[int, dict[str, dict[str, dict]]], backends: list[str]) -> int:
    print(table(results, backends))
    for world in sorted(results):
        spent = {b: sum(r["seconds"] for r in results[world][b].values()) for b in backends}
        print(f"\n{world} ranks, wall time of the runs: "
              + ", ".join(f"{b} {s:.0f} s" for b, s in spent.items()))
    if "gloo" not in backends or "gradstar" not in backends:
        return 0
    failures = regressions(results, "gloo", "gradstar")
    unexplained = [f for f in failures if not gloo_only(f[1], f[2])]
    print(f"\nTests gloo passes and gradstar fails: {len(failures)} "
          f"({len(failures) - len(unexplained)} gloo-only by torch's own check)")
    for world, test, error in failures:
        note = " [gloo-only]" if gloo_only(test, error) else ""
        print(f"- {world} ranks: {test}{note}: {error}")
    return 1 if unexplained else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--tests", nargs="+", help="these tests only (full names)")
    parser.add_argument("-k", dest="patterns", action="append",
                        help="tests whose name contains this (repeatable)")
    parser.add_argument("--start", choices=("fork", "spawn"), default="fork",
                        help="how rank processes start (upstream spawns; fork is faster and "
                             "runs the same tests)")
    parser.add_argument("--hub", choices=("shared", "store"), default="shared",
                        help="one coordinator for the run, a job per test (shared), or none "
                             "configured: rank 0 of each test starts one (store)")
    parser.add_argument("--test-timeout", type=float, default=120,
                        help="seconds torch allows one test before killing its ranks")
    parser.add_argument("--timeout", type=float, default=7200,
                        help="seconds allowed per world size")
    parser.add_argument("--json", type=Path, help="also write all results here")
    parser.add_argument("--suite-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.suite_process:
        args.world_size = args.world_sizes[0]
        return run_suite_process(args)
    if importlib.util.find_spec("expecttest") is None:
        parser.error("torch's test suite imports expecttest: pip install expecttest (it is in "
                     "gradstar's dev extras)")
    tests = args.tests or all_tests()
    if args.patterns:
        tests = [t for t in tests if any(p in t for p in args.patterns)]
    if not tests:
        parser.error("no test selected")
    results: dict[int, dict[str, dict[str, dict]]] = {}
    with (tempfile.TemporaryDirectory(prefix="torch-suite-results-") as folder,
          shared_hub(Path(folder) / "hub.log") if args.hub == "shared"
          else contextlib.nullcontext() as hub):
        for world in args.world_sizes:
            results[world] = run_world(world, tests, args, Path(folder), hub)
    if args.json:
        args.json.write_text(json.dumps({str(w): r for w, r in results.items()}, indent=1))
    return report(results, args.backends)


if __name__ == "__main__":
    sys.exit(main())
