"""``gradstar coordinator`` and ``gradstar shard``: the hub's processes, from their flags to a
server that drains on SIGINT/SIGTERM. Before binding, each checks its settings, tokens, TLS
files and ports, and says in one line what stops it (exit status 2)."""

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
from gradstar.cli.common import USAGE_ERROR, settings_error, unreadable
from gradstar.config import LOG_LEVELS, CoordinatorSettings, is_loopback
from gradstar.errors import GradstarError, NotLeaderError

#: Parsed arguments that are not settings fields (token files go in through the environment).
_NOT_SETTINGS = ("command", "func", "token_file", "admin_token_file")

# -- flags -------------------------------------------------------------------------------------


def coordinator_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
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
    _job_secret_arg(p)
    _insecure_arg(p)
    p.add_argument("--tls-cert", help="PEM certificate chain; enables TLS")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="CA that client certificates must chain to (mTLS)")
    p.add_argument("--max-tensor-bytes", type=int, help="largest payload a rank may send")
    _capacity_args(p)
    p.add_argument("--state-dir", help="directory for the jobs' global models (LocalSGD/DiLoCo) "
                   "and sync-mode snapshots")
    p.add_argument("--max-steps-bytes", type=int,
                   help="memory for sync-mode DDP steps: open steps' gradients, aggregate logs, "
                        "snapshots (4 GiB); past it HubCapacityError")
    p.add_argument("--steps-job-share", type=float,
                   help="the part of --max-steps-bytes one job may hold (0.5), so that one job "
                        "cannot refuse the others' steps")
    p.add_argument("--ha", metavar="etcd://HOST:PORT",
                   help="one of several coordinators, the leader elected through an etcd lease "
                        "(etcd://HOST:PORT[,HOST:PORT...][/PREFIX]); the others stand by and "
                        "take over when it goes (env GRADSTAR_HA; docs/kubernetes.md)")
    p.add_argument("--ha-ttl", type=int,
                   help="seconds of the leader's lease: how long a stopped leader takes to be "
                        "replaced (default 5)")
    p.add_argument("--ha-ca", metavar="FILE",
                   help="talk to etcd over TLS (https://), checking its certificate against "
                        "this CA (env GRADSTAR_HA_CA)")
    p.add_argument("--ha-cert", metavar="FILE",
                   help="with --ha-ca: this coordinator's certificate, for etcd's "
                        "--client-cert-auth")
    p.add_argument("--ha-key", metavar="FILE", help="the private key of --ha-cert")
    p.add_argument("--ha-advertise", metavar="HOST:PORT",
                   help="the address ranks reach this coordinator at, as the election "
                        "publishes it (default: --host and --port)")
    p.add_argument("--heartbeat-timeout", type=float, help="seconds without heartbeat = lost")
    p.add_argument("--job-retention", type=float,
                   help="seconds a job without members is kept before it is dropped (600)")
    p.add_argument("--max-jobs", type=int, help="jobs held at most; new ones beyond are refused")
    p.add_argument("--collective-port", type=int,
                   help="port for collectives' tensors, a server of its own with a keepalive "
                        "for full links (default 0: a free one; env GRADSTAR_COLLECTIVE_PORT); "
                        "open it where a firewall or a Service lists ports")
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
    p.add_argument("--stream-window-bytes", type=int,
                   help="bytes of each rank's stream gRPC takes in ahead of what the hub has "
                        "read (4 MiB); raise it for links whose bandwidth x round trip is "
                        "larger; 0: gRPC's own windows, unbounded")
    p.add_argument("--max-collective-state-bytes", type=int,
                   help="budget for the bookkeeping of all pending collectives (256 MiB); a "
                        "header beyond it is refused with HubCapacityError")
    p.add_argument("--collective-state-job-share", type=float, metavar="FRACTION",
                   help="the part of that budget one job may hold, so that one job filling "
                        "its share leaves room for the others (0.25; 1: no per-job limit)")
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


def _job_secret_arg(p: argparse.ArgumentParser) -> None:
    # A file only, never the value: the secret makes every job's token.
    p.add_argument("--job-secret-file", type=Path,
                   help="file holding the operator's job secret: each job's own token "
                        "(gradstar admin job-token) then opens that job only, beside the "
                        "shared token, which opens every job (env GRADSTAR_JOB_SECRET_FILE)")


def _shard_count(text: str) -> int:
    from gradstar.config import default_shard_count

    return default_shard_count() if text == "auto" else int(text)


def shard_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
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
    p.add_argument("--outbound-only", action="store_true", default=None,
                   help="this host takes no inbound connections from other hosts (NAT): "
                        "ranks on other hosts punch through to it (default: the coordinator "
                        "probes; env GRADSTAR_OUTBOUND_ONLY)")
    p.add_argument("--no-nat-traversal", dest="nat_traversal", action="store_false",
                   default=None,
                   help="on an outbound-only host, serve its own ranks only instead of taking "
                        "punched connections from other hosts (env GRADSTAR_NAT_TRAVERSAL=0)")
    p.add_argument("--tls-cert", help="PEM certificate chain to serve with; enables TLS")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="CA that client certificates must chain to (mTLS)")
    p.add_argument("--coordinator-ca", help="CA to verify the coordinator's certificate with")
    _token_args(p, on_command_line=False)
    _job_secret_arg(p)
    _insecure_arg(p)
    p.add_argument("--max-tensor-bytes", type=int, help="largest payload a rank may send")
    _capacity_args(p)
    p.add_argument("--max-chunk-bytes", type=int, help="largest chunk a rank may send")
    p.add_argument("--max-collective-timeout", type=float, help="longest collective timeout")
    _log_level_arg(p)
    return p



# -- running ---------------------------------------------------------------------------------------


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
    from gradstar.coordinator.shards import Shard

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


def shard_command(args: argparse.Namespace) -> int:
    from gradstar.config import ShardSettings
    from gradstar.errors import GradstarError

    settings = _server_settings(ShardSettings, args, "shard")
    if settings is None or not _can_serve(settings, "shard"):
        return USAGE_ERROR
    try:
        return asyncio.run(_serve_shard(settings))
    except RuntimeError as error:  # grpc's bind failure, if the port was taken after the check
        return bind_failed(error, settings, "shard")
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
        if await _until_elected(coordinator, settings, stop):
            _print_serving(coordinator, settings)
            await _unless_stopped(coordinator.fenced.wait(), stop)
    else:
        log.info("stopped while waiting for hub shards (%d of %d up)",
                 len(coordinator.shards.up), coordinator.shards.expected)
    log.info("stopping: draining for up to %.1f s", settings.drain_grace)
    await coordinator.stop()
    _default_signals()
    if coordinator.fenced.is_set():
        raise NotLeaderError(f"this coordinator no longer leads: "
                             f"{coordinator.leadership.fenced_because}; it stopped serving "
                             "(start it again to stand by)")


async def _until_elected(coordinator, settings: CoordinatorSettings,
                         stop: asyncio.Event) -> bool:
    """Under ``--ha``, stand by until this coordinator leads (a line says so); whether it
    does (False: stopped first)."""
    if not coordinator.elected.is_set():
        lead = coordinator.leadership
        _say(f"gradstar coordinator standby on {settings.host}:{coordinator.port} (leader: "
             f"{lead.leader or 'none yet'})")
    return await _unless_stopped(coordinator.elected.wait(), stop)


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
    _say(f"gradstar coordinator collectives on {settings.host}:{coordinator.collective_port}")



def _server_settings(cls, args: argparse.Namespace, command: str, **defaults):
    """``cls`` (a settings class) from the flags given, over ``defaults``, with logging set up;
    None (after printing why, in one line) if they are invalid."""
    given = {k: v for k, v in vars(args).items() if k not in _NOT_SETTINGS and v is not None}
    try:
        settings = cls(**{**defaults, **given})
    except ValidationError as error:
        print(f"gradstar {command}: {settings_error(error)}", file=sys.stderr)
        return None
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return settings


def _can_serve(settings: CoordinatorSettings, command: str) -> bool:
    """Whether ``settings`` may serve (tokens, see CoordinatorSettings.check_protected) and
    their ports can be bound; prints why not, in one line."""
    from gradstar.errors import ConfigurationError
    from gradstar.transport.bind import bind_problem
    from gradstar.transport.job_tokens import load_job_secret

    try:
        settings.check_protected()
    except ConfigurationError as error:
        print(f"gradstar {command}: {error}", file=sys.stderr)
        return False
    problem = unreadable({flag: getattr(settings, flag.strip("-").replace("-", "_"), None)
                           for flag in ("--tls-cert", "--tls-key", "--tls-client-ca",
                                        "--coordinator-ca")})
    if problem is not None:
        print(f"gradstar {command}: {problem}", file=sys.stderr)
        return False
    try:
        load_job_secret(settings.job_secret_file)  # read again when serving; refused here first
    except ConfigurationError as error:
        print(f"gradstar {command}: {error}", file=sys.stderr)
        return False
    ports = [(settings.host, settings.port, "--port")]
    if getattr(settings, "collective_port", None):
        ports.append((settings.host, settings.collective_port, "--collective-port"))
    if getattr(settings, "metrics_port", None) is not None:
        ports.append((settings.metrics_host, settings.metrics_port, "--metrics-port"))
    for host, port, flag in ports:
        problem = bind_problem(host, port, flag)  # with port 0 too: it checks the host
        if problem is not None:
            print(f"gradstar {command}: {problem}", file=sys.stderr)
            return False
    if (settings.insecure and settings.token is None and settings.job_secret_file is None
            and settings.tls_client_ca is None
            and not is_loopback(settings.host)):
        print(f"gradstar {command}: warning: --insecure: serving on {settings.host} without "
              "authentication; anyone who reaches the port can join jobs", file=sys.stderr,
              flush=True)
    return True



def bind_failed(error: RuntimeError, settings: CoordinatorSettings, command: str) -> int:
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


def coordinator_command(args: argparse.Namespace) -> int:
    settings = _server_settings(CoordinatorSettings, args, "coordinator",
                                shards=os.environ.get("GRADSTAR_SHARDS", "auto"))
    if settings is None or not _can_serve(settings, "coordinator"):
        return USAGE_ERROR
    try:
        asyncio.run(_serve(settings))
    except RuntimeError as error:  # grpc's bind failure, if the port was taken after the check
        return bind_failed(error, settings, "coordinator")
    except OSError as error:
        print(f"gradstar coordinator: {error}", file=sys.stderr)
        return 1
    except GradstarError as error:  # an unreachable --ha etcd, a lead lost
        print(f"gradstar coordinator: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0
