"""The gradstar command.

    gradstar coordinator [--port 29400] [--shards K]              run the hub
    gradstar shard --coordinator H:P [--port P]                  a hub shard on another host
    gradstar launch --nproc N [--coordinator H:P] script.py ...  N local ranks, like torchrun
    gradstar worker --coordinator H:P --job J [--nproc N] -- CMD the per-host agent
    gradstar demo [--workers 4] [--mode ddp|localsgd|...]        the main job: train, report
    gradstar admin status|jobs|drain|health --coordinator H:P    operator views

Flags fall back to GRADSTAR_* env vars. --token-file / --admin-token-file (or
GRADSTAR_TOKEN_FILE / GRADSTAR_ADMIN_TOKEN_FILE, read when the token variables themselves are
not set) name files holding the tokens (docker secrets). A token given as --token or
--admin-token works, with a warning: every local user sees it in ps. A coordinator or shard
listening beyond this machine (any --host but 127.0.0.1/localhost) needs a job token, or
--insecure.

Mistakes (a port in use, an invalid setting) end a command with one line on stderr and exit
status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable
from pathlib import Path

from pydantic import ValidationError

from gradstar.allocator import share_malloc_arena
from gradstar.config import DEFAULT_PORT, LOG_LEVELS, CoordinatorSettings, is_loopback

#: Exit status of a command refused because of how it was called or configured (as argparse).
USAGE_ERROR = 2

# -- coordinator -------------------------------------------------------------------------------


def _coordinator_args(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("coordinator", help="run the coordinator (hub) until SIGINT/SIGTERM",
                       allow_abbrev=False,
                       description="Run the coordinator. Flags override GRADSTAR_* env vars. "
                                   "On any address but loopback it needs a job token "
                                   "(GRADSTAR_TOKEN or --token-file) or --insecure; with "
                                   "--host 127.0.0.1 (this machine only) it runs without one.")
    p.add_argument("--host", help="address to bind (default 0.0.0.0: every interface, which "
                                  "needs a job token or --insecure; 127.0.0.1: this machine "
                                  "only, no token needed; env GRADSTAR_HOST)")
    p.add_argument("--port", type=int, help="port; 0 picks a free one (default 29400)")
    _token_args(p, on_command_line=True)
    _insecure_arg(p)
    p.add_argument("--tls-cert", help="PEM certificate chain; enables TLS")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="CA that client certificates must chain to (mTLS)")
    p.add_argument("--max-tensor-bytes", type=int, help="largest payload a rank may send")
    _capacity_args(p)
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
    p.add_argument("--metrics-max-bytes", type=int,
                   help="largest /metrics page in bytes; the series of jobs beyond it are left "
                        "out and counted (default 1 MiB; env GRADSTAR_METRICS_MAX_BYTES)")
    p.add_argument("--reflection", action="store_true", default=None,
                   help="register gRPC server reflection, open without a token (default off; "
                        "env GRADSTAR_REFLECTION)")
    _log_level_arg(p)
    p.add_argument("--shards", type=_shard_count,
                   help="data-plane shard processes to start here: a number, or 'auto' (the "
                        "default: one per two cores beyond the first two, at most 8; env "
                        "GRADSTAR_SHARDS)")
    p.add_argument("--expected-shards", type=int,
                   help="shards, local and remote, that must be up to report SERVING "
                        "(default: --shards)")
    return p


def _capacity_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-collective-state-bytes", type=int,
                   help="budget for the bookkeeping of all pending collectives (256 MiB); a "
                        "header beyond it is refused with HubCapacityError")
    p.add_argument("--max-pending-per-member", type=int,
                   help="collectives one rank may have pending at once (1024)")
    p.add_argument("--max-pending-per-job", type=int,
                   help="collectives one job may have pending at once (8192)")


def _log_level_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
                   help=f"{', '.join(LOG_LEVELS)} (default INFO; env GRADSTAR_LOG_LEVEL)")


def _insecure_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--insecure", action="store_true", default=None,
                   help="serve on a non-loopback --host without a job token: anyone who "
                        "reaches the port can join jobs, read their tensors and call Admin "
                        "(env GRADSTAR_INSECURE; not needed with mutual TLS)")


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


def _shard_args(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "shard", help="run a hub shard that registers with a coordinator", allow_abbrev=False,
        description="Run one data-plane shard: it registers with the coordinator (admin token, "
                    "or the job token when there is none) and carries a stripe of every "
                    "collective of the generations formed while it is up. Tokens come from "
                    "--token-file / --admin-token-file, else GRADSTAR_TOKEN / "
                    "GRADSTAR_ADMIN_TOKEN (or their _FILE variants).")
    p.add_argument("--coordinator", help="HOST:PORT of the coordinator (env GRADSTAR_COORDINATOR)")
    p.add_argument("--host", help="address to bind (default 0.0.0.0: every interface, which "
                                  "needs a job token or --insecure; env GRADSTAR_HOST)")
    p.add_argument("--port", type=int, help="port; 0 picks a free one (default 0)")
    p.add_argument("--advertise-host",
                   help="host ranks reach this shard at (default: the bound host, or for "
                        "0.0.0.0 this host's address on its route to the coordinator)")
    p.add_argument("--socket-ifname",
                   help="advertise this interface's IPv4 address (env GRADSTAR_SOCKET_IFNAME)")
    p.add_argument("--for-job",
                   help="serve only this job (a node-local shard beside its ranks); default: "
                        "every job")
    p.add_argument("--slot", type=int, help="slot to ask for (default: any free one)")
    p.add_argument("--tls-cert", help="PEM certificate chain to serve with; enables TLS")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="CA that client certificates must chain to (mTLS)")
    p.add_argument("--coordinator-ca", help="CA to verify the coordinator's certificate with")
    _token_args(p, on_command_line=False)
    _insecure_arg(p)
    p.add_argument("--max-tensor-bytes", type=int, help="largest payload a rank may send")
    _capacity_args(p)
    p.add_argument("--max-chunk-bytes", type=int, help="largest chunk a rank may send")
    p.add_argument("--max-collective-timeout", type=float, help="longest collective timeout")
    _log_level_arg(p)
    return p


def _stop_on_signals() -> asyncio.Event:
    """An event SIGINT and SIGTERM set (instead of killing), for a server to drain on."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    return stop


def _say(line: str) -> None:
    """One line on stdout in one write: a coordinator and its local shards share stdout, and
    print() writes the newline apart, so their lines could interleave mid-line (scripts read
    these lines to learn the address)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _default_signals() -> None:
    """Once a server has stopped, a SIGINT or SIGTERM has nothing left to drain: it ends the
    process at once (the default action). Without this, one arriving while asyncio tears the
    loop down, its wakeup fd already closed, printed "Exception ignored ... Bad file
    descriptor" with a traceback (a local shard gets its coordinator's SIGTERM just as it
    exits, having lost that coordinator)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_DFL)


async def _serve_shard(settings) -> int:
    from gradstar.coordinator.shard import Shard

    share_malloc_arena()  # before the shard's gRPC threads start
    shard = Shard(settings)
    stop = _stop_on_signals()
    try:
        # A signal while it waits for its coordinator (up to shard_wait) stops it at once.
        if not await _unless_stopped(shard.start(), stop):
            return 0
        _say(f"gradstar shard {shard.slot} listening on {settings.host}:{shard.port} "
             f"(advertised as {shard.address})")
        stopping = asyncio.ensure_future(stop.wait())
        closed = asyncio.ensure_future(shard.wait_closed())
        await asyncio.wait((stopping, closed), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        closed.cancel()
        await shard.stop()
        return 1 if shard.lost is not None else 0
    finally:
        _default_signals()


def _run_shard(args: argparse.Namespace) -> int:
    from gradstar.config import ShardSettings
    from gradstar.errors import GradstarError

    settings = _server_settings(ShardSettings, args, "shard")
    if settings is None or not _can_serve(settings, "shard"):
        return USAGE_ERROR
    try:
        return asyncio.run(_serve_shard(settings))
    except RuntimeError as error:  # grpc's bind failure, if the port was taken after the check
        return _bind_failed(error, settings, "shard")
    except (OSError, GradstarError) as error:
        print(f"gradstar shard: {error}", file=sys.stderr)
        return 1


async def _unless_stopped(work: Awaitable[None], stop: asyncio.Event) -> bool:
    """Await ``work`` unless ``stop`` is set first, which cancels it; whether it finished.

    Raises:
        Whatever ``work`` raises.
    """
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait((task, stopping), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if task.done():
        task.result()
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False


async def _serve(settings: CoordinatorSettings) -> None:
    from gradstar.coordinator import Coordinator

    log = logging.getLogger("gradstar.coordinator")
    share_malloc_arena()  # before the hub's gRPC threads start
    coordinator = Coordinator(settings)
    # Handlers first: a SIGTERM right after the "listening" line, or while the coordinator
    # waits for its shards, must drain, not kill (nor wait for the shards).
    stop = _stop_on_signals()
    await coordinator.listen()
    remote = coordinator.shards.expected - settings.shards
    if remote > 0:
        # Shards on other hosts need the port (--port 0) to register; "listening on" waits for
        # them, so it cannot be the line that tells them.
        _say(f"gradstar coordinator bound to {settings.host}:{coordinator.port}; waiting up "
             f"to {settings.shard_wait:g} s for hub shards ({remote} from other hosts)")
    if await _unless_stopped(coordinator.wait_for_shards(), stop):
        _print_serving(coordinator, settings)
        await stop.wait()
    else:
        log.info("stopped while waiting for hub shards (%d of %d up)",
                 len(coordinator.shards.up), coordinator.shards.expected)
    log.info("stopping: draining for up to %.1f s", settings.drain_grace)
    await coordinator.stop()
    _default_signals()


def _print_serving(coordinator, settings: CoordinatorSettings) -> None:
    """The lines a serving coordinator prints: its address (the line scripts wait for), its
    shards and its metrics endpoint."""
    _say(f"gradstar coordinator listening on {settings.host}:{coordinator.port}")
    if coordinator.shards.slots:
        _say(f"gradstar coordinator data plane: {len(coordinator.shards.up)} shards at "
             f"{', '.join(r.address for r in coordinator.shards.up)}")
    if coordinator.metrics_port is not None:
        _say(f"gradstar coordinator metrics on http://{settings.metrics_host}:"
             f"{coordinator.metrics_port}/metrics")
        _say(f"gradstar coordinator status page on http://{settings.metrics_host}:"
             f"{coordinator.metrics_port}/")


def _settings_error(error: ValidationError) -> str:
    """A settings ValidationError as one line: each field with its flag and variable, the
    value given (never a token's) and what is wrong with it."""
    parts = []
    for e in error.errors():
        field = ".".join(str(part) for part in e["loc"])
        what = e["msg"].removeprefix("Value error, ")
        what = what[:1].lower() + what[1:]
        if not field:
            parts.append(what)
            continue
        name = f"--{field.replace('_', '-')} (GRADSTAR_{field.upper()})"
        if e["type"] == "missing":
            parts.append(f"{name} is required")
        elif "token" in field:
            parts.append(f"invalid {name}: {what}")
        else:
            parts.append(f"invalid {name} {e.get('input')!r}: {what}")
    return "; ".join(parts)


def _server_settings(cls, args: argparse.Namespace, command: str, **defaults):
    """``cls`` (a settings class) from the flags given, over ``defaults``, with logging set up;
    None (after printing why, in one line) if they are invalid."""
    given = {k: v for k, v in vars(args).items() if k not in _NOT_SETTINGS and v is not None}
    try:
        settings = cls(**{**defaults, **given})
    except ValidationError as error:
        print(f"gradstar {command}: {_settings_error(error)}", file=sys.stderr)
        return None
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return settings


def _can_serve(settings: CoordinatorSettings, command: str) -> bool:
    """Whether ``settings`` may serve (tokens, see CoordinatorSettings.check_protected) and
    their ports can be bound; prints why not, in one line."""
    from gradstar.errors import ConfigurationError
    from gradstar.transport.bind import bind_problem

    try:
        settings.check_protected()
    except ConfigurationError as error:
        print(f"gradstar {command}: {error}", file=sys.stderr)
        return False
    problem = _unreadable({flag: getattr(settings, flag.strip("-").replace("-", "_"), None)
                           for flag in ("--tls-cert", "--tls-key", "--tls-client-ca",
                                        "--coordinator-ca")})
    if problem is not None:
        print(f"gradstar {command}: {problem}", file=sys.stderr)
        return False
    ports = [(settings.host, settings.port, "--port")]
    if getattr(settings, "metrics_port", None) is not None:
        ports.append((settings.metrics_host, settings.metrics_port, "--metrics-port"))
    for host, port, flag in ports:
        problem = bind_problem(host, port, flag)  # with port 0 too: it checks the host
        if problem is not None:
            print(f"gradstar {command}: {problem}", file=sys.stderr)
            return False
    if (settings.insecure and settings.token is None and settings.tls_client_ca is None
            and not is_loopback(settings.host)):
        print(f"gradstar {command}: warning: --insecure: serving on {settings.host} without "
              "authentication; anyone who reaches the port can join jobs", file=sys.stderr,
              flush=True)
    return True


def _unreadable(files: dict[str, Path | None]) -> str | None:
    """Why one of ``files`` (flag -> path, None when not given) cannot be read, or None."""
    for flag, path in files.items():
        if path is None:
            continue
        try:
            Path(path).read_bytes()
        except OSError as error:
            return f"cannot read {flag} {path}: {error.strerror or error}"
    return None


def _bind_failed(error: RuntimeError, settings: CoordinatorSettings, command: str) -> int:
    """grpc's "Failed to bind" (the port was taken between the check and the bind) as one line;
    any other RuntimeError is a bug and goes on up."""
    import errno

    from gradstar.transport.bind import describe_bind_error

    if not str(error).startswith("Failed to bind"):
        raise error
    taken = OSError(errno.EADDRINUSE, "address in use")
    print(f"gradstar {command}: {describe_bind_error(taken, settings.host, settings.port)}",
          file=sys.stderr)
    return USAGE_ERROR


def _run_coordinator(args: argparse.Namespace) -> int:
    settings = _server_settings(CoordinatorSettings, args, "coordinator",
                                shards=os.environ.get("GRADSTAR_SHARDS", "auto"))
    if settings is None or not _can_serve(settings, "coordinator"):
        return USAGE_ERROR
    try:
        asyncio.run(_serve(settings))
    except RuntimeError as error:  # grpc's bind failure, if the port was taken after the check
        return _bind_failed(error, settings, "coordinator")
    except OSError as error:
        print(f"gradstar coordinator: {error}", file=sys.stderr)
        return 1
    return 0


# -- launch ------------------------------------------------------------------------------------


def _launch_args(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "launch", help="run N ranks of a script on this machine (like torchrun)",
        allow_abbrev=False,
        description="Start N processes of SCRIPT with GRADSTAR_* set (an embedded coordinator "
                    "unless --coordinator is given), prefix their output with their rank, and "
                    "stop them all when one fails.")
    p.add_argument("--nproc", type=int, default=int(os.environ.get("GRADSTAR_NPROC", "1")),
                   help="rank processes (default 1, env GRADSTAR_NPROC)")
    p.add_argument("--coordinator", help="HOST:PORT of a running coordinator (default: start "
                                         "an embedded one on 127.0.0.1)")
    p.add_argument("--token-file", type=Path,
                   help="file holding the job token the ranks send (env GRADSTAR_TOKEN_FILE); "
                        "they get it in their environment, never on a command line")
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
    return p


def _run_launch(args: argparse.Namespace) -> int:
    from gradstar.worker.launch import LaunchOptions, run_launch, script_command

    if args.nproc < 1:
        print("gradstar launch: --nproc must be at least 1", file=sys.stderr)
        return USAGE_ERROR
    if not (args.module or args.no_python or Path(args.script).is_file()):
        # Said once here rather than by every rank's interpreter.
        print(f"gradstar launch: there is no file {args.script} (from {os.getcwd()}); give the "
              "path of a Python script, or -m MODULE, or --no-python EXECUTABLE",
              file=sys.stderr)
        return USAGE_ERROR
    command = script_command(args.script, args.script_args, module=args.module,
                             no_python=args.no_python)
    return run_launch(LaunchOptions(command, args.nproc, args.coordinator, args.job,
                                    args.max_restarts, args.stop_grace))


# -- worker ------------------------------------------------------------------------------------


def _worker_args(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "worker", help="the per-host agent: start, watch and restart local ranks",
        allow_abbrev=False,
        description="Wait for the coordinator, start NPROC ranks of COMMAND with GRADSTAR_* "
                    "set, restart dead ones (the others re-join the next generation) and "
                    "report health. Flags override GRADSTAR_* env vars.")
    p.add_argument("--coordinator", help="HOST:PORT (env GRADSTAR_COORDINATOR)")
    p.add_argument("--token-file", type=Path,
                   help="file holding the job token the ranks send (env GRADSTAR_TOKEN_FILE); "
                        "they get it in their environment, never on a command line")
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
    p.add_argument("--no-node-shard", dest="node_shard", action="store_false", default=None,
                   help="run no node-local hub shard on this host (default: one when the "
                        "job's ranks span hosts; env GRADSTAR_NODE_SHARD=0)")
    p.add_argument("rank_command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="what each rank runs, e.g. -- python -m gradstar.worker.train")
    return p


def _run_worker(args: argparse.Namespace) -> int:
    from gradstar.worker.agent import AgentSettings, run_agent

    command = list(args.rank_command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("gradstar worker: give the rank command after --, e.g. "
              "gradstar worker ... -- python -m gradstar.worker.train", file=sys.stderr)
        return USAGE_ERROR
    given = {k: v for k, v in vars(args).items()
             if k not in ("command", "rank_command") and v is not None}
    try:
        settings = AgentSettings(**given)
    except ValidationError as error:
        print(f"gradstar worker: {_settings_error(error)}", file=sys.stderr)
        return USAGE_ERROR
    problem = _unreadable({"GRADSTAR_TLS_CA": settings.tls_ca,
                           "GRADSTAR_TLS_CERT": settings.tls_cert,
                           "GRADSTAR_TLS_KEY": settings.tls_key})
    if problem is not None:
        print(f"gradstar worker: {problem}", file=sys.stderr)
        return USAGE_ERROR
    return run_agent(settings, command)


# -- demo --------------------------------------------------------------------------------------


def _demo_args(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from gradstar.worker.demo import MODES, DemoOptions

    d = DemoOptions()
    p = sub.add_parser(
        "demo", help="the main job: train a model across local worker processes and report",
        allow_abbrev=False,
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
    p.add_argument("--plot", type=Path, metavar="FILE.png",
                   help="also draw loss and test accuracy per epoch into this PNG (needs "
                        "matplotlib: pip install 'gradstar[plot]')")
    p.add_argument("--report", type=Path, metavar="FILE.json",
                   help="also write the report as JSON: per epoch, result, throughput, bytes "
                        "through the hub, the match with one process")
    return p


def _run_demo(args: argparse.Namespace) -> int:
    from gradstar.worker.demo import DemoOptions, run_demo

    if args.workers < 1:
        print("gradstar demo: --workers must be at least 1", file=sys.stderr)
        return USAGE_ERROR
    return run_demo(DemoOptions(workers=args.workers, mode=args.mode, epochs=args.epochs,
                                samples=args.samples, batch_size=args.batch_size,
                                hidden=args.hidden, lr=args.lr, sync_every=args.sync_every,
                                seed=args.seed, plot=args.plot, report=args.report))


# -- admin -------------------------------------------------------------------------------------


def _admin_args(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "admin", help="operator views of a coordinator: status, jobs, shards, drain, health",
        allow_abbrev=False,
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
    p.add_argument("--tls-ca", type=Path, default=os.environ.get("GRADSTAR_TLS_CA"),
                   help="CA certificate (PEM) to verify a TLS coordinator with; enables TLS "
                        "(env GRADSTAR_TLS_CA)")
    p.add_argument("--tls-cert", type=Path, help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", type=Path, help="key of --tls-cert")
    return p


def _run_admin(args: argparse.Namespace) -> int:
    from gradstar.errors import GradstarError
    from gradstar.worker.admin_command import run_admin

    problem = _unreadable({"--tls-ca": args.tls_ca, "--tls-cert": args.tls_cert,
                           "--tls-key": args.tls_key})
    if problem is not None:
        print(f"gradstar admin: {problem}", file=sys.stderr)
        return USAGE_ERROR
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

    parser = argparse.ArgumentParser(prog="gradstar", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"gradstar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {p.prog.split()[-1]: p for p in (
        _coordinator_args(sub), _shard_args(sub), _launch_args(sub), _worker_args(sub),
        _demo_args(sub), _admin_args(sub))}
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # with the subcommand's usage, not the top-level one (argparse's default)
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        _load_token_files(args)
    except OSError as error:
        print(f"gradstar: could not read a token file: {error}", file=sys.stderr)
        return USAGE_ERROR
    runners = {"coordinator": _run_coordinator, "shard": _run_shard, "launch": _run_launch,
               "worker": _run_worker,
               "demo": _run_demo, "admin": _run_admin}
    return runners[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
