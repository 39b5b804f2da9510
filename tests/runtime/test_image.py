"""The Dockerfile without docker: its HEALTHCHECK command runs against a live coordinator, and
its torch step installs the build the TORCH argument names (pip replaced by a stand-in that
prints what it was asked)."""

from __future__ import annotations

import asyncio
import os
import re
import stat
import sys
from pathlib import Path

import pytest

from .compose import ROOT
from .conftest import clean_env, communicate_or_kill


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments out."""
    joined, pending = [], ""
    for line in (ROOT / "Dockerfile").read_text(encoding="utf-8").splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1].strip()) for text in joined]


def the(keyword: str, containing: str = "") -> str:
    (found,) = [args for kind, args in instructions() if kind == keyword and containing in args]
    return found


def shims(folder: Path, **scripts: str) -> Path:
    """Executables named after ``scripts``' keys in ``folder``, each a shell script body."""
    folder.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = folder / name
        path.write_text(f"#!/bin/sh\n{body}\n", encoding="utf-8")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return folder


async def sh(command: str, env: dict[str, str], timeout: float = 30) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        "/bin/sh", "-c", command, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err, hung = await communicate_or_kill(proc, timeout)
    assert not hung, f"`{command}` hung: {err.decode()}"
    return proc.returncode, out.decode(), err.decode()


# -- HEALTHCHECK -----------------------------------------------------------------------------


def healthcheck() -> tuple[dict[str, str], str]:
    """The HEALTHCHECK's options and its command (shell form)."""
    text = the("HEALTHCHECK")
    options = dict(re.findall(r"--([\w-]+)=(\S+)", text.split(" CMD ", 1)[0]))
    return options, text.split(" CMD ", 1)[1].strip()


def test_the_image_has_a_healthcheck_over_the_grpc_health_protocol():
    options, command = healthcheck()
    assert set(options) >= {"interval", "timeout", "start-period", "retries"}
    assert command.split()[:3] == ["gradstar", "admin", "health"]  # grpc.health.v1 Check
    assert '"127.0.0.1:${GRADSTAR_PORT:-29400}"' in command  # the coordinator's own port
    # Its own deadline ends before docker's, so a hung hub reads as unhealthy, not as a kill.
    deadline = float(command.split("--timeout", 1)[1].split()[0])
    assert deadline < float(options["timeout"].rstrip("s"))
    assert the("CMD") == '["gradstar", "coordinator"]'


async def test_the_healthcheck_command_passes_while_serving_and_fails_draining_or_down(
        start_coordinator, tmp_path):
    _, command = healthcheck()
    # The image's `gradstar` is this interpreter's.
    bin_dir = shims(tmp_path / "bin", gradstar=f'exec "{sys.executable}" -m gradstar "$@"')
    hub = await start_coordinator()
    env = clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                    GRADSTAR_PORT=str(hub.port))
    assert await sh(command, env) == (0, "SERVING\n", "")
    await hub.drain()
    code, out, _ = await sh(command, env)
    assert (code, out) == (1, "NOT_SERVING\n")
    await hub.stop(grace=0)
    code, _, err = await sh(command, env)
    assert code == 1 and "could not reach the coordinator" in err


# -- the torch build argument ----------------------------------------------------------------


def torch_step() -> str:
    return the("RUN", '"torch==2.13.0"')


def build_arg_defaults() -> dict[str, str]:
    found = {}
    for args in (args for kind, args in instructions() if kind == "ARG"):
        name, _, value = args.partition("=")
        found[name] = value.strip('"')
    return found


@pytest.mark.parametrize(("build_args", "pip_args"), [
    ({}, "install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0"),
    ({"TORCH": "cpu", "TORCH_INDEX_URL": "https://mirror.example/cpu"},
     "install --index-url https://mirror.example/cpu torch==2.13.0"),
    ({"TORCH": "cuda"}, "install torch==2.13.0"),
    ({"TORCH": "cuda", "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cu999"},
     "install --index-url https://download.pytorch.org/whl/cu999 torch==2.13.0"),
])
async def test_the_torch_argument_picks_the_wheel_index(tmp_path, build_args, pip_args):
    defaults = build_arg_defaults()
    assert defaults == {"TORCH": "cpu", "TORCH_INDEX_URL": ""}
    bin_dir = shims(tmp_path / "bin", pip='echo "$@"')
    env = clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                    **{**defaults, **build_args})
    assert await sh(torch_step(), env) == (0, pip_args + "\n", "")


async def test_an_unknown_torch_build_fails_the_image_build(tmp_path):
    bin_dir = shims(tmp_path / "bin", pip='echo "$@"')
    env = clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", TORCH="rocm",
                    TORCH_INDEX_URL="")
    code, out, err = await sh(torch_step(), env)
    assert (code, out, err) == (2, "", "TORCH must be cpu or cuda, not 'rocm'\n")
