"""What every subcommand of the gradstar command shares: the exit status of a usage error, the
token files read into the environment before any command runs, and the one-line form of a
settings error or of a file that cannot be read."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pydantic import ValidationError

#: Exit status of a command refused because of how it was called or configured (as argparse).
USAGE_ERROR = 2

#: Token variable -> the argument names of its flag and of its file flag.
_TOKENS = {"GRADSTAR_TOKEN": ("token", "token_file"),
           "GRADSTAR_ADMIN_TOKEN": ("admin_token", "admin_token_file")}


def load_token_files(args: argparse.Namespace) -> None:
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




def settings_error(error: ValidationError) -> str:
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




def unreadable(files: dict[str, Path | None]) -> str | None:
    """Why one of ``files`` (flag -> path, None when not given) cannot be read, or None."""
    for flag, path in files.items():
        if path is None:
            continue
        try:
            Path(path).read_bytes()
        except OSError as error:
            return f"cannot read {flag} {path}: {error.strerror or error}"
    return None
