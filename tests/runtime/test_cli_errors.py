"""Everyday mistakes with the gradstar command end in one line on stderr that says what is wrong
and what to do, exit status 2, and nothing after it: no traceback, no asyncio or grpc noise.

Every case runs the real command (``python -m gradstar``) as a process, with a deadline; ports
"in use" are ones this test binds and listens on itself.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import socket
import sys
from collections.abc import Iterator

import pytest

from gradstar.config import CoordinatorSettings, ShardSettings, is_placeholder_token
from gradstar.coordinator import Coordinator
from gradstar.coordinator.shards import Shard
from gradstar.errors import ConfigurationError

from .compose import env_file
from .conftest import GRADSTAR, Lines, clean_env, communicate_or_kill, run_gradstar, stop_process

#: What a refused coordinator or shard prints after "gradstar coordinator: " / "gradstar shard: ".
UNPROTECTED = ("refusing to listen on 0.0.0.0 without a job token: anyone who reaches the port "
               "could join jobs and read their tensors; set GRADSTAR_TOKEN (or --token-file), or "
               "use --host 127.0.0.1 for this machine only, or pass --insecure to serve without "
               "authentication")
PLACEHOLDER = ("the {name} is a placeholder from an example, not a secret; set it to a long "
               "random string, e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))'")
#: Noise Python printed after a clean error before the fix, and tracebacks in general.
NOISE = ("Traceback", "Task was destroyed", "Event loop is closed", "Exception ignored",
         "Failed to bind", "add_port.cc")


def in_use(host: str, port: int, flag: str) -> str:
    return (f"{host}:{port} is already in use (another process listens there); stop it or "
            f"choose another {flag} (0 picks a free one)")


def the_line(err: str) -> str:
    """The one line of ``err``; fails if there is any other."""
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    return lines[0]


def token() -> str:
    return secrets.token_urlsafe(24)


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port on 127.0.0.1 that this test listens on for its duration."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


# -- ports and hosts -------------------------------------------------------------------------


async def test_a_coordinator_port_in_use_is_one_line(taken_port):
    code, out, err = await run_gradstar("coordinator", "--host", "127.0.0.1", "--port",
                                        str(taken_port), "--shards", "0", timeout=30)
    assert (code, out) == (2, "")
    assert the_line(err) == "gradstar coordinator: " + in_use("127.0.0.1", taken_port, "--port")


async def test_a_metrics_port_in_use_is_one_line(taken_port):
    code, _, err = await run_gradstar("coordinator", "--host", "127.0.0.1", "--port", "0",
                                      "--shards", "0", "--metrics-port", str(taken_port),
                                      timeout=30)
    assert code == 2
    assert the_line(err) == ("gradstar coordinator: "
                             + in_use("127.0.0.1", taken_port, "--metrics-port"))


async def test_a_shard_port_in_use_is_one_line(taken_port):
    code, _, err = await run_gradstar("shard", "--coordinator", "127.0.0.1:1", "--host",
                                      "127.0.0.1", "--port", str(taken_port), timeout=30)
    assert code == 2
    assert the_line(err) == "gradstar shard: " + in_use("127.0.0.1", taken_port, "--port")


async def test_a_worker_health_port_in_use_is_one_line(taken_port):
    code, _, err = await run_gradstar(
        "worker", "--coordinator", "127.0.0.1:1", "--health-host", "127.0.0.1",
        "--health-port", str(taken_port), "--", sys.executable, "-c", "pass", timeout=30)
    assert code == 2
    assert the_line(err) == ("gradstar worker: "
                             + in_use("127.0.0.1", taken_port, "--health-port"))


async def test_a_host_that_is_not_this_machines_is_one_line():
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): documentation only, never a local address.
    code, _, err = await run_gradstar("coordinator", "--host", "192.0.2.1", "--shards", "0",
                                      env=clean_env(GRADSTAR_TOKEN=token()), timeout=30)
    assert code == 2
    assert the_line(err) == (
        "gradstar coordinator: 192.0.2.1 is not an address of this machine, so nothing can "
        "listen on it; use one of its addresses, 127.0.0.1 for this machine only, or 0.0.0.0 "
        "for every interface")


async def test_a_host_that_does_not_resolve_is_one_line():
    code, _, err = await run_gradstar("coordinator", "--host", "no-such-host.invalid",
                                      "--insecure", "--shards", "0", timeout=60)
    assert code == 2
    # The resolver's own words go in the parentheses (they differ with and without DNS).
    assert re.fullmatch(
        r"gradstar coordinator: cannot resolve --host 'no-such-host\.invalid' \([^()]+\); give "
        r"an address of this machine, 127\.0\.0\.1 for this machine only, or 0\.0\.0\.0 for "
        r"every interface", the_line(err)), err


def test_grpcs_own_bind_failure_is_the_same_line(capsys):
    # A port taken between the command's check and gRPC's bind: gRPC raises RuntimeError.
    from gradstar.cli import _bind_failed

    settings = CoordinatorSettings(host="127.0.0.1", port=29999)
    failed = RuntimeError("Failed to bind to address 127.0.0.1:29999; set GRPC_VERBOSITY=debug")
    assert _bind_failed(failed, settings, "coordinator") == 2
    assert capsys.readouterr().err == ("gradstar coordinator: "
                                       + in_use("127.0.0.1", 29999, "--port") + "\n")
    with pytest.raises(RuntimeError, match="something else"):
        _bind_failed(RuntimeError("something else"), settings, "coordinator")


async def test_port_0_logs_the_port_it_bound():
    proc = await asyncio.create_subprocess_exec(
        *GRADSTAR, "coordinator", "--host", "127.0.0.1", "--port", "0", "--shards", "0",
        env=clean_env(), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        printed = await Lines(proc.stdout).wait_for(r"listening on 127\.0\.0\.1:(\d+)$", 30)
        logged = await Lines(proc.stderr).wait_for(r"coordinator serving on ([\d.]+):(\d+) ", 30)
        assert printed[1] != "0"
        assert (logged[1], logged[2]) == ("127.0.0.1", printed[1])
    finally:
        await stop_process(proc)


# -- flags and settings ----------------------------------------------------------------------


async def test_an_unknown_log_level_is_refused_by_argparse_with_the_choices():
    code, out, err = await run_gradstar("coordinator", "--log-level", "VERBOSE", timeout=30)
    assert (code, out) == (2, "")
    assert err.startswith("usage: gradstar coordinator ")
    assert re.fullmatch(
        r"gradstar coordinator: error: argument --log-level: invalid choice: 'VERBOSE' \(choose "
        r"from '?DEBUG'?, '?INFO'?, '?WARNING'?, '?ERROR'?, '?CRITICAL'?\)",
        err.splitlines()[-1]), err
    assert not any(noise in err for noise in NOISE)


async def test_a_log_level_in_lower_case_is_taken(taken_port):
    # Accepted: the command goes on to the next check, the port.
    code, _, err = await run_gradstar("coordinator", "--log-level", "debug", "--host",
                                      "127.0.0.1", "--port", str(taken_port), timeout=30)
    assert code == 2
    assert the_line(err) == "gradstar coordinator: " + in_use("127.0.0.1", taken_port, "--port")


async def test_an_unknown_log_level_from_the_environment_is_one_line():
    code, _, err = await run_gradstar("coordinator", "--host", "127.0.0.1",
                                      env=clean_env(GRADSTAR_LOG_LEVEL="VERBOSE"), timeout=30)
    assert code == 2
    assert the_line(err) == (
        "gradstar coordinator: invalid --log-level (GRADSTAR_LOG_LEVEL) 'VERBOSE': should be one "
        "of DEBUG, INFO, WARNING, ERROR, CRITICAL")


@pytest.mark.parametrize(("args", "line"), [
    (("coordinator", "--port", "70000"),
     "gradstar coordinator: invalid --port (GRADSTAR_PORT) 70000: input should be less than or "
     "equal to 65535"),
    (("worker", "--", "true"),
     "gradstar worker: --coordinator (GRADSTAR_COORDINATOR) is required"),
    (("shard", "--host", "127.0.0.1", "--slot", "-5"),
     "gradstar shard: invalid --slot (GRADSTAR_SLOT) -5: input should be greater than or equal "
     "to -1"),
])
async def test_invalid_settings_are_one_line(args, line):
    code, _, err = await run_gradstar(*args, timeout=30)
    assert (code, the_line(err)) == (2, line)


@pytest.mark.parametrize(("args", "flag"), [
    (("admin", "health", "--coordinator", "127.0.0.1:1", "--tls-ca"), "--tls-ca"),
    (("coordinator", "--host", "127.0.0.1", "--port", "0", "--tls-key", "{k}", "--tls-cert"),
     "--tls-cert"),
    (("shard", "--host", "127.0.0.1", "--coordinator-ca"), "--coordinator-ca"),
])
async def test_a_tls_file_that_is_not_there_is_one_line(tmp_path, args, flag):
    (tmp_path / "key.pem").write_text("not read before the certificate\n")
    missing = tmp_path / "missing.pem"
    args = [a.format(k=tmp_path / "key.pem") for a in args]
    code, _, err = await run_gradstar(*args, str(missing), timeout=30)
    assert (code, the_line(err)) == (
        2, f"gradstar {args[0]}: cannot read {flag} {missing}: No such file or directory")


async def test_a_workers_tls_file_that_is_not_there_is_one_line(tmp_path):
    missing = tmp_path / "ca.pem"
    code, _, err = await run_gradstar("worker", "--coordinator", "127.0.0.1:1", "--", "true",
                                      env=clean_env(GRADSTAR_TLS_CA=str(missing)), timeout=30)
    assert (code, the_line(err)) == (
        2, f"gradstar worker: cannot read GRADSTAR_TLS_CA {missing}: No such file or directory")


async def test_launching_a_script_that_is_not_there_is_one_line(tmp_path):
    missing = tmp_path / "train.py"
    code, out, err = await run_gradstar("launch", "--nproc", "2", str(missing), "--epochs", "1",
                                        timeout=30)
    assert (code, out) == (2, "")
    assert the_line(err).startswith(f"gradstar launch: there is no file {missing} (from ")
    assert err.rstrip().endswith("give the path of a Python script, or -m MODULE, or "
                                 "--no-python EXECUTABLE")


@pytest.mark.parametrize(("args", "unknown"), [
    (("demo", "--worker", "2"), "--worker 2"),  # not taken for --workers
    (("coordinator", "--hos", "127.0.0.1"), "--hos 127.0.0.1"),  # not taken for --host
    (("coordinator", "--prot", "5"), "--prot 5"),
    (("admin", "health", "--coord", "127.0.0.1:1"), "--coord 127.0.0.1:1"),
    (("launch", "--nprocs", "2", "train.py"), "--nprocs"),
])
async def test_flags_are_never_abbreviated_and_a_mistyped_one_shows_its_commands_usage(
        args, unknown):
    code, out, err = await run_gradstar(*args, timeout=30)
    assert (code, out) == (2, "")
    command = args[0]
    assert err.startswith(f"usage: gradstar {command} "), err  # the subcommand's usage
    assert err.splitlines()[-1] == f"gradstar {command}: error: unrecognized arguments: {unknown}"


@pytest.mark.parametrize("command", ["", "coordinator", "shard", "launch", "worker", "demo",
                                     "admin"])
async def test_help_has_no_rest_markup(command):
    code, out, _ = await run_gradstar(*filter(None, [command]), "--help", timeout=30)
    assert code == 0 and out.startswith("usage: gradstar")
    assert "`" not in out


async def test_every_admin_flag_has_help_including_tls_ca():
    code, out, _ = await run_gradstar("admin", "--help", timeout=30)
    assert code == 0
    assert re.search(r"--tls-ca TLS_CA\s+CA certificate \(PEM\) to verify", out), out
    # A flag alone on its line (argparse's layout for a long one) has its help on the next,
    # indented under the help column; a flag without help has nothing there.
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if re.fullmatch(r"  --[\w-]+( [A-Z_]+)?", line):
            assert lines[i + 1].startswith(" " * 20) and lines[i + 1].strip(), line


# -- authentication by default ---------------------------------------------------------------


async def test_a_coordinator_on_every_interface_without_a_token_refuses_to_start():
    code, out, err = await run_gradstar("coordinator", timeout=30)  # default host 0.0.0.0
    assert (code, out) == (2, "")
    assert the_line(err) == "gradstar coordinator: " + UNPROTECTED


async def test_a_shard_on_every_interface_without_a_token_refuses_to_start():
    code, _, err = await run_gradstar("shard", "--coordinator", "127.0.0.1:1", timeout=30)
    assert (code, the_line(err)) == (2, "gradstar shard: " + UNPROTECTED)


async def _serves(*args: str, env: dict[str, str]) -> tuple[str, list[str]]:
    """Start ``gradstar coordinator ARGS``; (the address it says it listens on, its stderr
    lines so far); stopped again."""
    proc = await asyncio.create_subprocess_exec(
        *GRADSTAR, "coordinator", "--port", "0", "--shards", "0", "--log-level", "WARNING",
        *args, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    errors = Lines(proc.stderr)
    try:
        address = (await Lines(proc.stdout).wait_for(r"listening on (\S+)$", 30))[1]
    finally:
        await stop_process(proc)
    await errors.finish()
    return address, errors.lines


async def test_every_interface_with_a_token_or_insecure_and_loopback_without_one_start():
    address, errors = await _serves("--host", "0.0.0.0", env=clean_env(GRADSTAR_TOKEN=token()))
    assert address.startswith("0.0.0.0:") and errors == []
    address, errors = await _serves("--host", "127.0.0.1", env=clean_env())
    assert address.startswith("127.0.0.1:") and errors == []
    address, errors = await _serves("--host", "0.0.0.0", "--insecure", env=clean_env())
    assert address.startswith("0.0.0.0:")
    assert errors[:1] == ["gradstar coordinator: warning: --insecure: serving on 0.0.0.0 without "
                          "authentication; anyone who reaches the port can join jobs"]
    address, _ = await _serves("--host", "0.0.0.0", env=clean_env(GRADSTAR_INSECURE="1"))
    assert address.startswith("0.0.0.0:")


async def test_the_local_shards_of_an_insecure_coordinator_serve_too():
    # They bind the coordinator's host; without --insecure passed on they would refuse, and
    # the coordinator would never report its shards up (nor print that it listens).
    address, errors = await _serves("--host", "0.0.0.0", "--insecure", "--shards", "1",
                                    env=clean_env())
    assert address.startswith("0.0.0.0:")
    assert sum("warning: --insecure" in line for line in errors) == 2, errors  # hub and shard


async def test_the_library_refuses_the_same_settings_the_command_does():
    with pytest.raises(ConfigurationError) as refused:
        await Coordinator(CoordinatorSettings(host="0.0.0.0", port=0)).start()
    assert str(refused.value) == UNPROTECTED
    with pytest.raises(ConfigurationError, match=r"refusing to listen on 0\.0\.0\.0 without"):
        await Shard(ShardSettings(host="0.0.0.0", port=0)).start()


def test_mutual_tls_or_a_token_protects_and_loopback_needs_neither(tmp_path):
    for settings in (CoordinatorSettings(host="0.0.0.0", token=token()),
                     CoordinatorSettings(host="0.0.0.0", tls_cert=tmp_path / "c",
                                         tls_key=tmp_path / "k", tls_client_ca=tmp_path / "ca"),
                     CoordinatorSettings(host="127.0.0.1"), CoordinatorSettings(host="::1"),
                     CoordinatorSettings(host="localhost"),
                     CoordinatorSettings(host="0.0.0.0", insecure=True)):
        settings.check_protected()  # raises nothing
    for host in ("0.0.0.0", "::", "", "10.1.2.3", "hub.example"):
        with pytest.raises(ConfigurationError, match="refusing to listen on"):
            CoordinatorSettings(host=host).check_protected()
    # TLS without client certificates authenticates nobody: still a token or --insecure.
    with pytest.raises(ConfigurationError, match="refusing to listen on"):
        CoordinatorSettings(host="0.0.0.0", tls_cert=tmp_path / "c",
                            tls_key=tmp_path / "k").check_protected()


@pytest.mark.parametrize("variable", ["GRADSTAR_TOKEN", "GRADSTAR_ADMIN_TOKEN"])
async def test_the_env_example_placeholder_tokens_are_refused_even_on_loopback(variable):
    name = {"GRADSTAR_TOKEN": "job token (GRADSTAR_TOKEN)",
            "GRADSTAR_ADMIN_TOKEN": "admin token (GRADSTAR_ADMIN_TOKEN)"}[variable]
    placeholder = env_file()[variable]  # what .env.example ships
    code, _, err = await run_gradstar("coordinator", "--host", "127.0.0.1", "--port", "0",
                                      env=clean_env(**{variable: placeholder}), timeout=30)
    assert (code, the_line(err)) == (2, "gradstar coordinator: " + PLACEHOLDER.format(name=name))
    assert placeholder not in err


async def test_a_placeholder_in_a_token_file_is_refused_by_the_shard_too(tmp_path):
    (tmp_path / "token").write_text("change-me\n")
    code, _, err = await run_gradstar("shard", "--coordinator", "127.0.0.1:1", "--host",
                                      "127.0.0.1", "--token-file", str(tmp_path / "token"),
                                      timeout=30)
    assert (code, the_line(err)) == (
        2, "gradstar shard: " + PLACEHOLDER.format(name="job token (GRADSTAR_TOKEN)"))


def test_placeholders_are_example_values_and_real_tokens_are_not():
    for value in (*env_file().values(), "change-me", "CHANGEME", "replace-with-anything",
                  "<your token>", " change-me\n"):
        if "TOKEN" in value.upper() or "change" in value.lower() or "replace" in value:
            assert is_placeholder_token(value), value
    for value in (token(), "job-secret", "s3cret", "admin-token", "4"):
        assert not is_placeholder_token(value), value


# -- no noise after a clean error ------------------------------------------------------------

_JOIN = """
import sys, gradstar
gradstar.init_process_group(coordinator=sys.argv[1], job="noise", world_size=int(sys.argv[2]),
                            token=sys.argv[3], join_timeout=20)
"""


async def _rank(address: str, world_size: int, job_token: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", _JOIN, address, str(world_size), job_token, env=clean_env(),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)


async def _ends_with(proc: asyncio.subprocess.Process, error: str) -> None:
    """The rank ended with ``error`` as the last line of its stderr, and nothing after it."""
    _, err, hung = await communicate_or_kill(proc, 60)
    text = err.decode()
    assert not hung, text
    assert proc.returncode == 1, text
    assert text.splitlines()[-1].startswith(f"gradstar.errors.{error}: "), text
    assert text.count("Traceback") == 1, text  # the script's own, for its uncaught error
    for noise in NOISE[1:]:
        assert noise not in text, text


async def test_no_asyncio_noise_after_a_wrong_token(start_coordinator):
    hub = await start_coordinator(token=token())
    await _ends_with(await _rank(hub.address, 1, "not-the-token"), "AuthenticationError")


async def test_no_asyncio_noise_after_a_world_size_disagreement(start_coordinator):
    job_token = token()
    hub = await start_coordinator(token=job_token)
    first = await _rank(hub.address, 2, job_token)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while "noise" not in hub.rendezvous.jobs:  # the first rank's join is waiting
            assert loop.time() < deadline and first.returncode is None
            await asyncio.sleep(0.05)
        await _ends_with(await _rank(hub.address, 3, job_token), "WorldSizeMismatchError")
        await _ends_with(first, "WorldSizeMismatchError")  # told, not left waiting
    finally:
        await stop_process(first)
