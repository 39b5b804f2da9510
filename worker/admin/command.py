"""``gradstar admin``: what each action asks the coordinator and prints (the flags are in
:mod:`gradstar.cli`, the tables in :mod:`.tables`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

from gradstar.errors import CoordinatorUnavailableError

from . import tables
from .client import AdminClient


def _token(args: argparse.Namespace) -> str | None:
    return (args.admin_token or os.environ.get("GRADSTAR_ADMIN_TOKEN")
            or os.environ.get("GRADSTAR_TOKEN"))


def _client(args: argparse.Namespace, address: str) -> AdminClient:
    return AdminClient(address, _token(args), tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                       tls_key=args.tls_key, timeout=args.timeout)


async def leader_views(args: argparse.Namespace) -> list[dict]:
    """Each coordinator of ``--coordinator`` (one, or several under --ha) on who leads."""
    views = []
    for address in [a.strip() for a in args.coordinator.split(",") if a.strip()]:
        async with _client(args, address) as admin:
            try:
                views.append(tables.leadership_as_dict(address, await admin.leadership()))
            except CoordinatorUnavailableError as error:
                views.append(tables.leadership_as_dict(address, None, str(error)))
    return views


async def run_admin(args: argparse.Namespace) -> int:
    """``gradstar admin ACTION``: one action against one coordinator (with several, the one
    that leads); the exit status."""
    if args.action == "leader":
        views = await leader_views(args)
        print(json.dumps(views, indent=2) if args.json
              else tables.leadership_table(views, time.time()))
        return 0 if any(v.get("role") == "leader" for v in views) else 1
    if "," in args.coordinator:  # several coordinators (--ha): ask the one that leads
        leaders = [v["coordinator"] for v in await leader_views(args) if v.get("role") == "leader"]
        args.coordinator = leaders[0] if leaders else args.coordinator.split(",")[0].strip()
    async with _client(args, args.coordinator) as admin:
        if args.action == "health":
            if args.wait > 0:
                await admin.wait_serving(args.wait)
            status = await admin.health()
            print(json.dumps({"coordinator": args.coordinator, "status": status})
                  if args.json else status)
            return 0 if status == "SERVING" else 1
        if args.action == "drain":
            active = await admin.drain()
            print(json.dumps({"coordinator": args.coordinator, "draining": True,
                              "active_jobs": active}) if args.json else
                  f"coordinator {args.coordinator} is draining: new joins are refused; "
                  f"{active} job(s) still have live members")
            return 0
        if args.action == "shards":
            reply = await admin.shards()
            print(json.dumps(tables.shards_as_dict(reply), indent=2) if args.json
                  else tables.shards_table(reply))
            return 0
        if args.action in ("rounds", "steps"):
            if args.job is None:
                print(f"gradstar admin {args.action}: name the job with --job", file=sys.stderr)
                return 2
            if args.action == "rounds":
                reply = await admin.rounds(args.job)
                print(json.dumps(tables.rounds_as_dict(args.job, reply), indent=2) if args.json
                      else tables.rounds_table(args.job, reply))
            else:
                reply = await admin.steps(args.job)
                print(json.dumps(tables.steps_as_dict(args.job, reply), indent=2) if args.json
                      else tables.steps_table(args.job, reply))
            return 0
        if args.action == "stragglers":
            if args.job is None:
                print("gradstar admin stragglers: name the job with --job", file=sys.stderr)
                return 2
            reply = await admin.stragglers(args.job, args.limit)
            print(json.dumps(tables.stragglers_as_dict(reply), indent=2) if args.json
                  else tables.stragglers_table(reply))
            return 0
        jobs = await admin.jobs()
        if args.action == "jobs":
            print(json.dumps([tables.summary_as_dict(j) for j in jobs], indent=2)
                  if args.json else tables.jobs_table(jobs))
            return 0
        names = [j.job for j in jobs if args.job in (None, j.job)]
        if args.job is not None and not names:
            print(f"gradstar admin: the coordinator has no job named {args.job!r}",
                  file=sys.stderr)
            return 1
        health = await admin.health()
        before = [await admin.job(n) for n in names]
        rates = None
        if args.interval > 0 and names:
            loop = asyncio.get_running_loop()
            began = loop.time()
            await asyncio.sleep(args.interval)
            after = [await admin.job(n) for n in names]
            span = loop.time() - began
            rates = {n: tables.rates_between(b, a, span)
                     for n, b, a in zip(names, before, after, strict=True)}
            before = after
        if args.json:
            print(json.dumps({"coordinator": args.coordinator, "health": health,
                              "jobs": [tables.job_as_dict(j, (rates or {}).get(j.summary.job))
                                       for j in before]}, indent=2))
        else:
            print(tables.status_report(args.coordinator, health, before, rates))
        return 0
