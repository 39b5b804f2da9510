"""``gradstar admin``: the operator's views of a running coordinator (status, jobs, shards,
rounds, stragglers, drain, health), whose calls and tables are
:mod:`gradstar.worker.admin.command`; and ``job-token``, which prints a job's own token from the
job secret, offline (:mod:`gradstar.transport.job_tokens`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from gradstar.cli.common import USAGE_ERROR, unreadable
from gradstar.config import DEFAULT_PORT


def admin_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "admin", help="operator views of a coordinator: status, jobs, shards, rounds, stragglers, "
             "drain, health",
        allow_abbrev=False,
        description="status: every job (or --job) with members, generation, in-flight "
                    "collectives and the ranks they wait for, traffic and throughput. jobs: one "
                    "line per job. shards: the data-plane shards with address, state, traffic "
                    "and jobs. rounds: a job's fault-tolerant outer rounds (StreamingDiLoCo): "
                    "replicas per round, missed rounds and joins. steps: a job's sync-mode DDP "
                    "steps (Quorum, BoundedStaleness, Asynchronous): steps closed, live ranks, "
                    "drops and staleness. stragglers: who a job's "
                    "collectives wait for, ranks slowest first (host, median and p95 arrival "
                    "lag, share of collectives last, seconds the others waited). drain: "
                    "refuse new joins (running jobs finish). leader: each coordinator of "
                    "--coordinator (a comma list under --ha) on who leads, its term, since "
                    "when, the takeovers and how long ranks waited; exit 0 if one leads. "
                    "health: exit 0 if the "
                    "coordinator is SERVING (for container health checks). job-token: print "
                    "--job's own token, made from --job-secret-file without asking any "
                    "coordinator; give it to that job's ranks as GRADSTAR_TOKEN.")
    p.add_argument("action", choices=("status", "jobs", "shards", "rounds", "steps",
                                      "stragglers", "drain", "health", "leader",
                                      "job-token"))
    p.add_argument("--coordinator",
                   default=os.environ.get("GRADSTAR_COORDINATOR", f"127.0.0.1:{DEFAULT_PORT}"),
                   help="HOST:PORT, or several separated by commas (coordinators under "
                        "--ha: the one that leads is asked) (env GRADSTAR_COORDINATOR, "
                        "default 127.0.0.1:29400)")
    token = p.add_mutually_exclusive_group()
    token.add_argument("--admin-token", help="admin token (env GRADSTAR_ADMIN_TOKEN, else "
                                             "GRADSTAR_TOKEN); visible in ps")
    token.add_argument("--admin-token-file", type=Path,
                       help="file holding the admin token (env GRADSTAR_ADMIN_TOKEN_FILE)")
    p.add_argument("--job-secret-file", type=Path,
                   default=os.environ.get("GRADSTAR_JOB_SECRET_FILE"),
                   help="job-token: the file holding the coordinator's job secret (env "
                        "GRADSTAR_JOB_SECRET_FILE)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--job", help="status: only this job; rounds, steps, stragglers, job-token: "
                                 "the job (required)")
    p.add_argument("--limit", type=int, default=0,
                   help="stragglers: at most this many ranks, slowest first (default 0: all)")
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


def admin_command(args: argparse.Namespace) -> int:
    from gradstar.errors import GradstarError
    from gradstar.worker.admin.command import run_admin

    if args.action == "job-token":
        return job_token_command(args)

    problem = unreadable({"--tls-ca": args.tls_ca, "--tls-cert": args.tls_cert,
                           "--tls-key": args.tls_key})
    if problem is not None:
        print(f"gradstar admin: {problem}", file=sys.stderr)
        return USAGE_ERROR
    try:
        return asyncio.run(run_admin(args))
    except GradstarError as error:
        print(f"gradstar admin: {error}", file=sys.stderr)
        return 1


def job_token_command(args: argparse.Namespace) -> int:
    """``gradstar admin job-token --job J --job-secret-file PATH``: J's own token on stdout."""
    from gradstar.errors import ConfigurationError
    from gradstar.transport.job_tokens import load_job_secret

    if args.job is None or args.job_secret_file is None:
        print("gradstar admin job-token: name the job with --job and the secret with "
              "--job-secret-file (or GRADSTAR_JOB_SECRET_FILE)", file=sys.stderr)
        return USAGE_ERROR
    try:
        token = load_job_secret(args.job_secret_file).token_for(args.job)
    except ConfigurationError as error:
        print(f"gradstar admin job-token: {error}", file=sys.stderr)
        return USAGE_ERROR
    print(json.dumps({"job": args.job, "token": token}) if args.json else token)
    return 0
