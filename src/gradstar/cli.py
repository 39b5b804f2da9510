"""The ``gradstar`` command.

    gradstar coordinator [--port 29400] [--shards K]              run the hub
    gradstar shard --coordinator H:P [--port P]                  a hub shard on another host
    gradstar launch --nproc N [--coordinator H:P] script.py ...  N local ranks, like torchrun
    gradstar worker --coordinator H:P --job J [--nproc N] -- CMD the per-host agent
    gradstar demo [--workers 4] [--mode ddp|localsgd|...]        the main job: train, report
    gradstar admin status|jobs|drain|health --coordinator H:P    operator views

Flags fall back to ``GRADSTAR_*`` env vars. ``--token-file`` / ``--admin-token-file`` (or
``GRADSTAR_TOKEN_FILE`` / ``GRADSTAR_ADMIN_TOKEN_FILE``, read when the token variables
themselves are not set) name files holding the tokens (docker secrets). A token given as
``--token`` or ``--admin-token`` works, with a warning: every local user sees it in ``ps``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from pydantic import ValidationError

from gradstar.config import DEFAULT_PORT, CoordinatorSettings

# -- coordinator -------------------------------------------------------------------------------


def _coordinator_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coordinator", help="run the coordinator (hub) until SIGINT/SIGTERM",
                       description="Run the coordinator. Flags override GRADSTAR_* env vars.")
    p.add_argument("--host", help="address to bind (default 0.0.0.0, env GRADSTAR_HOST)")
    p.add_argument("--port", type=int, help="port; 0 picks a free one (default 29400)")
    _token_args(p, on_command_line=True)
    p.add_argument("--tls-cert", help="PEM certificate chain; enables TLS")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="CA that client certificates must chain to (mTLS)")
    p.add_argument("--max-tensor-bytes", type=int, help="largest payload a rank may send")
    p.add_argument("--state-dir", help="directory for the jobs' global models (LocalSGD/DiLoCo)")
    p.add_argument("--heartbeat-timeout", type=float, help="seconds without heartbeat = lost")
    p.add_argument("--job-retention", type=float,
                   help="seconds a job without members is kept before it is dropped (600)")
    p.add_argument("--max-jobs", type=int, help="jobs held at most; new ones beyond are refused")
    p.add_argument("--metrics-port", type=int,
                   help="serve Prometheus metrics on http://HOST:PORT/metrics (0: a free port; "
                        "env GRADSTAR_METRICS_PORT)")
    p.add_argument("--metrics-host",
                   help="address the metrics endpoint binds (default 127.0.0.1: this host "
                        "only; env GRADSTAR_METRICS_HOST)")
    p.add_argument("--reflection", action="store_true", default=None,
                   help="register gRPC server reflection, open without a token (default off; "
                        "env GRADSTAR_REFLECTION)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING (default INFO)")
    p.add_argument("--shards", type=_shard_count,
                   help="data-plane shard processes to start here: a number, or 'auto' (the "
                        "default: one per two cores beyond the first two, at most 8; env "
                        "GRADSTAR_SHARDS)")
    p.add_argument("--expected-shards", type=int,
                   help="shards, local and remote, that must be up to report SERVING "
                        "(default: --shards)")


def _token_args(p: argparse.ArgumentParser, *, on_command_line: bool) -> None:
    """``--token-file`` and ``--admin-token-file``; with ``on_command_line`` also ``--token`` and
    ``--admin-token``, each exclusive with its file form."""
    job = p.add_mutually_exclusive_group()
    admin = p.add_mutually_exclusive_group()
    if on_command_line:
        job.add_argument("--token", help="job token ranks must send; visible in ps, prefer "
                                         "--token-file or env GRADSTAR_TOKEN")
        admin.add_argument("--admin-token", help="token for Admin calls and shard registration; "
                                                 "visible in ps, prefer --admin-token-file or "
                                                 "env GRADSTAR_ADMIN_TOKEN")
    job.add_argument("--token-file", type=Path,
                     help="file holding the job token (env GRADSTAR_TOKEN_FILE)")
    admin.add_argument("--admin-token-file", type=Path,
                       help="file holding the admin token (env GRADSTAR_ADMIN_TOKEN_FILE)")


def _shard_count(text: str) -> int:
    from gradstar.config import default_shard_count

    return default_shard_count() if text == "auto" else int(text)


def _shard_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "shard", help="run a hub shard that registers with a coordinator",
        description="Run one data-plane shard: it registers with the coordinator (admin token, "
                    "or the job token when there is none) and carries a stripe of every "
                    "collective of the generations formed while it is up. Tokens come from "
                    "--token-file / --admin-token-file, else GRADSTAR_TOKEN / "
                    "GRADSTAR_ADMIN_TOKEN (or their _FILE variants).")
    p.add_argument("--coordinator", help="HOST:PORT of the coordinator (env GRADSTAR_COORDINATOR)")
    p.add_argument("--host", help="address to bind (default 0.0.0.0)")
    p.add_argument("--port", type=int, help="port; 0 picks a free one (default 0)")
    p.add_argument("--advertise-host",
                   help="host ranks reach this shard at (default: the bound host, or this "
                        "machine's hostname for a wildcard)")
    p.add_argument("--slot", type=int, help="slot to ask for (default: any free one)")
    p.add_argument("--tls-cert", help="PEM certificate chain to serve with; enables TLS")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="CA that client certificates must chain to (mTLS)")
    p.add_argument("--coordinator-ca", help="CA to verify the coordinator's certificate with")
    _token_args(p, on_command_line=False)
    p.add_argument("--max-tensor-bytes", type=int, help="largest payload a rank may send")
    p.add_argument("--max-chunk-bytes", type=int, help="largest chunk a rank may send")
    p.add_argument("--max-collective-timeout", type=float, help="longest collective timeout")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING (default INFO)")


def _stop_on_signals() -> asyncio.Event:
    """An event SIGINT and SIGTERM set (instead of killing), for a server to drain on."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    return stop


async def _serve_shard(settings) -> int:
    from gradstar.coordinator.shard import Shard

    shard = Shard(settings)
    stop = _stop_on_signals()
    await shard.start()
    print(f"gradstar shard {shard.slot} listening on {settings.host}:{shard.port} "
          f"(advertised as {shard.address})", flush=True)
    stopping = asyncio.ensure_future(stop.wait())
    closed = asyncio.ensure_future(shard.wait_closed())
    await asyncio.wait((stopping, closed), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    closed.cancel()
    await shard.stop()
    return 1 if shard.lost is not None else 0


def _run_shard(args: argparse.Namespace) -> int:
    from gradstar.config import ShardSettings
    from gradstar.errors import GradstarError

    settings = _server_settings(ShardSettings, args, "shard")
    if settings is None:
        return 2
    try:
        return asyncio.run(_serve_shard(settings))
    except (OSError, GradstarError) as error:
        print(f"gradstar shard: {error}", file=sys.stderr)
        return 1


async def _serve(settings: CoordinatorSettings) -> None:
    from gradstar.coordinator import Coordinator

    coordinator = Coordinator(settings)
    # Handlers first: a SIGTERM right after the "listening" line must drain, not kill.
    stop = _stop_on_signals()
    await coordinator.start()
    print(f"gradstar coordinator listening on {settings.host}:{coordinator.port}", flush=True)
    if coordinator.shards.slots:
        print(f"gradstar coordinator data plane: {len(coordinator.shards.up)} shards at "
              f"{', '.join(r.address for r in coordinator.shards.up)}", flush=True)
    if coordinator.metrics_port is not None:
        print(f"gradstar coordinator metrics on http://{settings.metrics_host}:"
              f"{coordinator.metrics_port}/metrics", flush=True)
    await stop.wait()
    logging.getLogger("gradstar.coordinator").info("stopping: draining for up to %.1f s",
                                                   settings.drain_grace)
    await coordinator.stop()


def _server_settings(cls, args: argparse.Namespace, command: str, **defaults):
    """``cls`` (a settings class) from the flags given, over ``defaults``, with logging set up;
    None (after printing why) if they are invalid."""
    given = {k: v for k, v in vars(args).items() if k not in _NOT_SETTINGS and v is not None}
    try:
        settings = cls(**{**defaults, **given})
    except ValidationError as error:
        print(f"gradstar {command}: invalid settings:\n{error}", file=sys.stderr)
        return None
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return settings


def _run_coordinator(args: argparse.Namespace) -> int:
    settings = _server_settings(CoordinatorSettings, args, "coordinator",
                                shards=os.environ.get("GRADSTAR_SHARDS", "auto"))
    if settings is None:
        return 2
    try:
        asyncio.run(_serve(settings))
    except OSError as error:
        print(f"gradstar coordinator: {error}", file=sys.stderr)
        return 1
    return 0


# -- launch ------------------------------------------------------------------------------------


def _launch_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch", help="run N ranks of a script on this machine (like torchrun)",
        description="Start N processes of SCRIPT with GRADSTAR_* set (an embedded coordinator "
                    "unless --coordinator is given), prefix their output with their rank, and "
                    "stop them all when one fails.")
    p.add_argument("--nproc", type=int, default=int(os.environ.get("GRADSTAR_NPROC", "1")),
                   help="rank processes (default 1, env GRADSTAR_NPROC)")
    p.add_argument("--coordinator", help="HOST:PORT of a running coordinator (default: start "
                                         "an embedded one on 127.0.0.1)")
    p.add_argument("--job", default=os.environ.get("GRADSTAR_JOB", "launch"),
                   help="job name (default 'launch', env GRADSTAR_JOB)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart failed ranks up to this many times in total (default 0)")
    p.add_argument("--stop-grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default 5)")
    p.add_argument("-m", "--module", action="store_true",
                   help="SCRIPT is a module name, run as python -m SCRIPT")
    p.add_argument("--no-python", action="store_true",
                   help="SCRIPT is an executable, run without the Python interpreter")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def _run_launch(args: argparse.Namespace) -> int:
    from gradstar.worker.launch import LaunchOptions, run_launch, script_command

    if args.nproc < 1:
        print("gradstar launch: --nproc must be at least 1", file=sys.stderr)
        return 2
    command = script_command(args.script, args.script_args, module=args.module,
                             no_python=args.no_python)
    return run_launch(LaunchOptions(command, args.nproc, args.coordinator, args.job,
                                    args.max_restarts, args.stop_grace))


# -- worker ------------------------------------------------------------------------------------


def _worker_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker", help="the per-host agent: start, watch and restart local ranks",
        description="Wait for the coordinator, start NPROC ranks of COMMAND with GRADSTAR_* "
                    "set, restart dead ones (the others re-join the next generation) and "
                    "report health. Flags override GRADSTAR_* env vars.")
    p.add_argument("--coordinator", help="HOST:PORT (env GRADSTAR_COORDINATOR)")
    p.add_argument("--job", help="job name (env GRADSTAR_JOB, default 'default')")
    p.add_argument("--nproc", type=int, help="ranks on this host (env GRADSTAR_NPROC, default 1)")
    p.add_argument("--world-size", type=int,
                   help="ranks of the whole job on all hosts (env GRADSTAR_WORLD_SIZE, default "
                        "NPROC); when larger than NPROC the coordinator assigns ranks")
    p.add_argument("--max-restarts", type=int,
                   help="rank restarts allowed in total (env GRADSTAR_MAX_RESTARTS, default 0)")
    p.add_argument("--health-port", type=int,
                   help="serve GET /healthz on this port (0: a free one; env GRADSTAR_HEALTH_PORT)")
    p.add_argument("--health-host", help="address of the health endpoint (default 0.0.0.0)")
    p.add_argument("--stop-grace", type=float, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--wait-coordinator", type=float,
                   help="seconds to wait for the coordinator to be SERVING (default 120)")
    p.add_argument("rank_command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="what each rank runs, e.g. -- python -m gradstar.worker.train")


def _run_worker(args: argparse.Namespace) -> int:
    from gradstar.worker.agent import AgentSettings, run_agent

    command = list(args.rank_command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("gradstar worker: give the rank command after --, e.g. "
              "gradstar worker ... -- python -m gradstar.worker.train", file=sys.stderr)
        return 2
    given = {k: v for k, v in vars(args).items()
             if k not in ("command", "rank_command") and v is not None}
    try:
        settings = AgentSettings(**given)
    except ValidationError as error:
        print(f"gradstar worker: invalid settings:\n{error}", file=sys.stderr)
        return 2
    return run_agent(settings, command)


# -- demo --------------------------------------------------------------------------------------


def _demo_args(sub: argparse._SubParsersAction) -> None:
    from gradstar.worker.demo import MODES, DemoOptions

    d = DemoOptions()
    p = sub.add_parser(
        "demo", help="the main job: train a model across local worker processes and report",
        description="Start an embedded coordinator and WORKERS rank processes that train an MLP "
                    "on a generated spirals dataset, then report accuracy, throughput, bytes "
                    "through the hub and whether the result matches a single-process run.")
    p.add_argument("--workers", type=int, default=d.workers,
                   help=f"rank processes (default {d.workers})")
    p.add_argument("--mode", choices=MODES, default=d.mode, help=f"default {d.mode}")
    p.add_argument("--epochs", type=int, default=d.epochs, help=f"default {d.epochs}")
    p.add_argument("--samples", type=int, default=d.samples,
                   help=f"dataset size, train + test (default {d.samples})")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"rows per rank and step (default {d.batch_size})")
    p.add_argument("--hidden", type=int, default=d.hidden, help=f"default {d.hidden}")
    p.add_argument("--lr", type=float, default=d.lr, help=f"default {d.lr}")
    p.add_argument("--sync-every", type=int, default=d.sync_every,
                   help=f"localsgd: steps between averaging rounds (default {d.sync_every})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"default {d.seed}")


def _run_demo(args: argparse.Namespace) -> int:
    from gradstar.worker.demo import DemoOptions, run_demo

    if args.workers < 1:
        print("gradstar demo: --workers must be at least 1", file=sys.stderr)
        return 2
    return run_demo(DemoOptions(workers=args.workers, mode=args.mode, epochs=args.epochs,
                                samples=args.samples, batch_size=args.batch_size,
                                hidden=args.hidden, lr=args.lr, sync_every=args.sync_every,
                                seed=args.seed))


# -- admin -------------------------------------------------------------------------------------


def _admin_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "admin", help="operator views of a coordinator: status, jobs, shards, drain, health",
        description="status: every job (or --job) with members, generation, in-flight "
                    "collectives and the ranks they wait for, traffic and throughput. jobs: one "
                    "line per job. shards: the data-plane shards with address, state, traffic "
                    "and jobs. drain: refuse new joins (running jobs finish). health: exit 0 "
                    "if the coordinator is SERVING (for container health checks).")
    p.add_argument("action", choices=("status", "jobs", "shards", "drain", "health"))
    p.add_argument("--coordinator",
                   default=os.environ.get("GRADSTAR_COORDINATOR", f"127.0.0.1:{DEFAULT_PORT}"),
                   help="HOST:PORT (env GRADSTAR_COORDINATOR, default 127.0.0.1:29400)")
    token = p.add_mutually_exclusive_group()
    token.add_argument("--admin-token", help="admin token (env GRADSTAR_ADMIN_TOKEN, else "
                                             "GRADSTAR_TOKEN); visible in ps")
    token.add_argument("--admin-token-file", type=Path,
                       help="file holding the admin token (env GRADSTAR_ADMIN_TOKEN_FILE)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--job", help="status: only this job")
    p.add_argument("--interval", type=float, default=1.0,
                   help="status: seconds between the two samples throughput is measured over "
                        "(default 1; 0 skips throughput)")
    p.add_argument("--wait", type=float, default=0.0,
                   help="health: wait up to this many seconds for SERVING (default 0)")
    p.add_argument("--timeout", type=float, default=10.0, help="per-call deadline (default 10)")
    p.add_argument("--tls-ca", type=Path, default=os.environ.get("GRADSTAR_TLS_CA"))
    p.add_argument("--tls-cert", type=Path, help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", type=Path, help="key of --tls-cert")


def _run_admin(args: argparse.Namespace) -> int:
    from gradstar.errors import GradstarError
    from gradstar.worker.admin_command import run_admin

    try:
        return asyncio.run(run_admin(args))
    except GradstarError as error:
        print(f"gradstar admin: {error}", file=sys.stderr)
        return 1


# -- entry point -------------------------------------------------------------------------------


#: Parsed arguments that are not settings fields (token files go in through the environment).
_NOT_SETTINGS = ("command", "func", "token_file", "admin_token_file")
#: Token variable -> the argument names of its flag and of its file flag.
_TOKENS = {"GRADSTAR_TOKEN": ("token", "token_file"),
           "GRADSTAR_ADMIN_TOKEN": ("admin_token", "admin_token_file")}


def _load_token_files(args: argparse.Namespace) -> None:
    """Token files -> ``GRADSTAR_TOKEN`` / ``GRADSTAR_ADMIN_TOKEN``, for docker secrets.

    ``--token-file`` / ``--admin-token-file`` win over the environment, like every flag;
    ``GRADSTAR_TOKEN_FILE`` / ``GRADSTAR_ADMIN_TOKEN_FILE`` are read when the token variable
    itself is not set. The variables go into this process's environment, so the ranks that a
    launcher or agent starts inherit the token as well. A token passed as a flag gets a warning.

    Raises:
        OSError: a token file could not be read, or holds nothing but whitespace.
    """
    for name, (flag, file_flag) in _TOKENS.items():
        if getattr(args, flag, None) is not None:
            print(f"gradstar: warning: --{flag.replace('_', '-')} on the command line is "
                  f"visible to every local user in ps; use {name} or "
                  f"--{file_flag.replace('_', '-')}", file=sys.stderr, flush=True)
        path = getattr(args, file_flag, None)
        if path is None and not os.environ.get(name):
            path = os.environ.get(f"{name}_FILE") or None
        if path is not None:
            token = Path(path).read_text(encoding="utf-8").strip()
            if not token:
                # An empty token would mean "no authentication": never by accident.
                raise OSError(f"the token file {path} is empty")
            os.environ[name] = token


def main(argv: list[str] | None = None) -> int:
    from gradstar import __version__

    parser = argparse.ArgumentParser(prog="gradstar", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"gradstar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _coordinator_args(sub)
    _shard_args(sub)
    _launch_args(sub)
    _worker_args(sub)
    _demo_args(sub)
    _admin_args(sub)
    args = parser.parse_args(argv)
    try:
        _load_token_files(args)
    except OSError as error:
        print(f"gradstar: could not read a token file: {error}", file=sys.stderr)
        return 2
    runners = {"coordinator": _run_coordinator, "shard": _run_shard, "launch": _run_launch,
               "worker": _run_worker,
               "demo": _run_demo, "admin": _run_admin}
    return runners[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
