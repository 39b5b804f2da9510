"""docker-compose.yml as data, for tests that check it and run its services without docker."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"

_VARIABLE = re.compile(r"\$\{(\w+)(?::([?-])([^}]*))?\}")


def env_file(path: Path = ENV_EXAMPLE) -> dict[str, str]:
    """KEY=VALUE lines of an env file (comments and blank lines skipped)."""
    values = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def interpolate(value, variables: dict[str, str]):
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}`` in strings, recursively.

    Raises:
        KeyError: a ``:?`` variable is unset or empty (compose refuses the file then).
    """
    if isinstance(value, dict):
        return {k: interpolate(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, variables) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        name, kind, arg = match[1], match[2], match[3]
        got = variables.get(name, "")
        if got:
            return got
        if kind == "?":
            raise KeyError(f"{name}: {arg}")
        return arg if kind == "-" else ""

    return _VARIABLE.sub(substitute, value)


def load_compose(**variables: str) -> dict:
    """docker-compose.yml with ``.env.example`` (and ``variables``) interpolated."""
    raw = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    return interpolate(raw, {**env_file(), **variables})


def local_argv(command: list[str]) -> list[str]:
    """A service command as this machine runs it: the image's ``gradstar`` and ``python``
    are this interpreter's (also after a ``--``, for the agent's rank command)."""
    if "--" in command:
        cut = command.index("--")
        return [*local_argv(command[:cut]), "--", *local_argv(command[cut + 1:])]
    head, *rest = command
    if head == "gradstar":
        return [sys.executable, "-m", "gradstar", *rest]
    if head == "python":
        return [sys.executable, *rest]
    return list(command)


def service_env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the KEY=VALUE list form
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def healthcheck_argv(service: dict) -> list[str]:
    test = service["healthcheck"]["test"]
    assert test[0] in ("CMD", "CMD-SHELL"), test
    return list(test[1:])
