"""The ``gradstar`` command: ``gradstar coordinator`` runs the hub, ``gradstar demo`` shows it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from pydantic import ValidationError

from gradstar.config import CoordinatorSettings


def _coordinator_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coordinator", help="run the coordinator (hub) until SIGINT/SIGTERM",
                       description="Run the coordinator. Flags override GRADSTAR_* env vars.")
    p.add_argument("--host", help="address to bind (default 0.0.0.0, env GRADSTAR_HOST)")
    p.add_argument("--port", type=int, help="port; 0 picks a free one (default 29400)")
    p.add_argument("--token", help="job token ranks must send (prefer env GRADSTAR_TOKEN)")
    p.add_argument("--admin-token", help="token for Admin calls (env GRADSTAR_ADMIN_TOKEN)")
    p.add_argument("--tls-cert", help="PEM certificate chain; enables TLS")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="CA that client certificates must chain to (mTLS)")
    p.add_argument("--max-tensor-bytes", type=int, help="largest payload a rank may send")
    p.add_argument("--state-dir", help="directory for the jobs' global models (LocalSGD/DiLoCo)")
    p.add_argument("--heartbeat-timeout", type=float, help="seconds without heartbeat = lost")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING (default INFO)")


async def _serve(settings: CoordinatorSettings) -> None:
    from gradstar.coordinator import Coordinator

    coordinator = Coordinator(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Handlers first: a SIGTERM right after the "listening" line must drain, not kill.
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await coordinator.start()
    print(f"gradstar coordinator listening on {settings.host}:{coordinator.port}", flush=True)
    await stop.wait()
    logging.getLogger("gradstar.coordinator").info("stopping: draining for up to %.1f s",
                                                   settings.drain_grace)
    await coordinator.stop()


def _run_coordinator(args: argparse.Namespace) -> int:
    given = {k: v for k, v in vars(args).items() if k not in ("command", "func") and v is not None}
    try:
        settings = CoordinatorSettings(**given)
    except ValidationError as error:
        print(f"gradstar coordinator: invalid settings:\n{error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_serve(settings))
    except OSError as error:
        print(f"gradstar coordinator: {error}", file=sys.stderr)
        return 1
    return 0


def _demo_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="start a coordinator and run collectives across local ranks")
    p.add_argument("--workers", type=int, default=4, help="number of rank processes (default 4)")
    p.add_argument("--mb", type=float, default=16.0, help="all_reduce size in MB (default 16)")
    p.add_argument("--rounds", type=int, default=5, help="all_reduce rounds (default 5)")


def _run_demo(args: argparse.Namespace) -> int:
    from gradstar.worker.collective_demo import run_demo

    return run_demo(workers=args.workers, megabytes=args.mb, rounds=args.rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradstar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _coordinator_args(sub)
    _demo_args(sub)
    args = parser.parse_args(argv)
    runners = {"coordinator": _run_coordinator, "demo": _run_demo}
    return runners[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
