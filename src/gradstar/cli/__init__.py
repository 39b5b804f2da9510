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
import sys

# The docstring above is the command's --help. Each subcommand group has its own module: .serve
# (coordinator, shard), .launch (launch, worker), .demo and .admin; what they share is .common.
from gradstar.cli.admin import admin_command, admin_parser
from gradstar.cli.common import USAGE_ERROR, load_token_files
from gradstar.cli.demo import demo_command, demo_parser
from gradstar.cli.launch import launch_command, launch_parser, worker_command, worker_parser
from gradstar.cli.serve import (
    bind_failed,
    coordinator_command,
    coordinator_parser,
    shard_command,
    shard_parser,
)

#: Its name before the subcommands had their own modules (tests import it).
_bind_failed = bind_failed

__all__ = ["USAGE_ERROR", "main"]


def main(argv: list[str] | None = None) -> int:
    from gradstar import __version__

    parser = argparse.ArgumentParser(prog="gradstar", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"gradstar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {p.prog.split()[-1]: p for p in (
        coordinator_parser(sub), shard_parser(sub), launch_parser(sub), worker_parser(sub),
        demo_parser(sub), admin_parser(sub))}
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # with the subcommand's usage, not the top-level one (argparse's default)
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        load_token_files(args)
    except OSError as error:
        print(f"gradstar: could not read a token file: {error}", file=sys.stderr)
        return USAGE_ERROR
    runners = {"coordinator": coordinator_command, "shard": shard_command,
               "launch": launch_command, "worker": worker_command, "demo": demo_command,
               "admin": admin_command}
    return runners[args.command](args)

