"""``gradstar launch`` (N ranks of a script on this machine, like torchrun) and ``gradstar
worker`` (the per-host agent that starts, watches and restarts a host's ranks)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from gradstar.cli.common import USAGE_ERROR, settings_error, unreadable

# -- launch ----------------------------------------------------------------------------------------


def launch_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
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


def launch_command(args: argparse.Namespace) -> int:
    from gradstar.worker.host.launch import LaunchOptions, run_launch, script_command

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


def worker_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
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
    p.add_argument("--shard-tls-cert", type=Path,
                   help="with TLS: a server certificate for this host (its address toward the "
                        "coordinator in its SAN), so that the node-local shard serves the "
                        "ranks over TLS (env GRADSTAR_SHARD_TLS_CERT); without it a TLS job "
                        "runs no node-local shard")
    p.add_argument("--shard-tls-key", type=Path,
                   help="the private key of --shard-tls-cert (env GRADSTAR_SHARD_TLS_KEY)")
    p.add_argument("rank_command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="what each rank runs, e.g. -- python -m gradstar.worker.demo.train")
    return p


def worker_command(args: argparse.Namespace) -> int:
    from gradstar.worker.host.agent import AgentSettings, run_agent

    command = list(args.rank_command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("gradstar worker: give the rank command after --, e.g. "
              "gradstar worker ... -- python -m gradstar.worker.demo.train", file=sys.stderr)
        return USAGE_ERROR
    given = {k: v for k, v in vars(args).items()
             if k not in ("command", "rank_command") and v is not None}
    try:
        settings = AgentSettings(**given)
    except ValidationError as error:
        print(f"gradstar worker: {settings_error(error)}", file=sys.stderr)
        return USAGE_ERROR
    problem = unreadable({"GRADSTAR_TLS_CA": settings.tls_ca,
                           "GRADSTAR_TLS_CERT": settings.tls_cert,
                           "GRADSTAR_TLS_KEY": settings.tls_key,
                           "--shard-tls-cert": settings.shard_tls_cert,
                           "--shard-tls-key": settings.shard_tls_key})
    if problem is not None:
        print(f"gradstar worker: {problem}", file=sys.stderr)
        return USAGE_ERROR
    return run_agent(settings, command)
