"""Tokens for ``gradstar coordinator`` / ``shard`` / ``admin`` from files, and a warning for a
token on the command line (where every local user sees it in ``ps``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

import gradstar
from gradstar import errors

from .conftest import GRADSTAR, Lines, clean_env, run_gradstar, stop_process

WARNING = "visible to every local user in ps; use GRADSTAR_TOKEN or --token-file"


@pytest.fixture
def secrets(tmp_path):
    (tmp_path / "token").write_text("job-secret\n")
    (tmp_path / "admin").write_text("admin-secret\n")
    return tmp_path / "token", tmp_path / "admin"


async def test_the_coordinator_takes_its_tokens_from_files(secrets):
    token, admin = secrets
    proc = await asyncio.create_subprocess_exec(
        *GRADSTAR, "coordinator", "--host", "127.0.0.1", "--port", "0", "--shards", "0",
        "--token-file", str(token), "--admin-token-file", str(admin), "--log-level", "WARNING",
        env=clean_env(GRADSTAR_TOKEN="not-this-one"), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        out, err = Lines(proc.stdout), Lines(proc.stderr)
        address = (await out.wait_for(r"listening on (\S+)$", 20))[1]
        with pytest.raises(errors.AuthenticationError):
            await gradstar.init_process_group_async(coordinator=address, job="f", world_size=1,
                                                    token="not-this-one", connect_timeout=5)
        async with await gradstar.init_process_group_async(
                coordinator=address, job="f", world_size=1, token="job-secret") as g:
            np.testing.assert_array_equal(await g.all_reduce(np.ones(2)), np.ones(2))
            code, listed, why = await run_gradstar(
                "admin", "jobs", "--coordinator", address, "--admin-token-file", str(admin),
                timeout=30)
            assert code == 0 and "f" in listed.split(), why
        assert "warning" not in err.text
    finally:
        await stop_process(proc)


async def test_a_shard_takes_its_tokens_from_files(start_coordinator, secrets):
    hub = await start_coordinator(token="job-secret", admin_token="admin-secret")
    token, admin = secrets
    proc = await asyncio.create_subprocess_exec(
        *GRADSTAR, "shard", "--coordinator", hub.address, "--host", "127.0.0.1", "--port", "0",
        "--token-file", str(token), "--admin-token-file", str(admin), "--log-level", "WARNING",
        env=clean_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        await Lines(proc.stdout).wait_for(r"gradstar shard \d+ listening", 20)
        assert len(hub.shards.up) == 1
    finally:
        await stop_process(proc)


@pytest.mark.parametrize(("flag", "hint"), [
    ("--token", WARNING),
    ("--admin-token", "use GRADSTAR_ADMIN_TOKEN or --admin-token-file"),
])
async def test_a_token_on_the_command_line_gets_a_warning(flag, hint):
    # An invalid port ends the command right after the flags are read.
    code, _, err = await run_gradstar("coordinator", "--port", "70000", flag, "s3cret",
                                      timeout=30)
    assert code == 2 and hint in err and f"warning: {flag} on the command line" in err
    assert "s3cret" not in err


async def test_an_empty_or_missing_token_file_or_two_tokens_are_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    code, _, err = await run_gradstar("coordinator", "--token-file", str(empty), timeout=30)
    assert code == 2 and f"the token file {empty} is empty" in err
    code, _, err = await run_gradstar("shard", "--admin-token-file", str(tmp_path / "nope"),
                                      timeout=30)
    assert code == 2 and "could not read a token file" in err
    code, _, err = await run_gradstar("coordinator", "--token", "a", "--token-file", str(empty),
                                      timeout=30)
    assert code == 2 and "not allowed with argument" in err
    for command in ("launch", "worker"):  # the launcher and the agent read one for their ranks
        code, _, err = await run_gradstar(command, "--token-file", str(empty), "x.py",
                                          timeout=30)
        assert code == 2 and f"the token file {empty} is empty" in err, (command, err)


async def test_launch_gives_its_ranks_the_token_from_a_file(start_coordinator, secrets):
    hub = await start_coordinator(token="job-secret")
    token, _ = secrets
    script = str(Path(__file__).with_name("rank_script.py"))
    code, out, err = await run_gradstar("launch", "--nproc", "2", "--coordinator", hub.address,
                                        "--token-file", str(token), "--job", "tf", script, "sum",
                                        timeout=90)
    assert code == 0, err[-3000:]
    assert "job-secret" not in out + err
    # Without it the ranks are refused: the file is what let them in.
    code, _, err = await run_gradstar("launch", "--nproc", "1", "--coordinator", hub.address,
                                      "--job", "tf-none", script, "sum", timeout=90)
    assert code != 0 and "job token missing" in err, err[-3000:]


async def test_a_rank_reads_its_token_from_the_file_gradstar_token_file_names(
        start_coordinator, secrets, tmp_path, monkeypatch):
    hub = await start_coordinator(token="job-secret")
    token, _ = secrets
    monkeypatch.delenv("GRADSTAR_TOKEN", raising=False)
    monkeypatch.setenv("GRADSTAR_TOKEN_FILE", str(token))
    async with await gradstar.init_process_group_async(
            coordinator=hub.address, job="rank-file", world_size=1, connect_timeout=5) as g:
        np.testing.assert_array_equal(await g.all_reduce(np.ones(2)), np.ones(2))
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    for path, why in ((empty, "is empty"), (tmp_path / "nope", "cannot read the token file")):
        monkeypatch.setenv("GRADSTAR_TOKEN_FILE", str(path))
        with pytest.raises(errors.ConfigurationError, match=why):
            await gradstar.init_process_group_async(coordinator=hub.address, job="rank-file",
                                                    world_size=1, connect_timeout=5)


async def test_a_streaming_diloco_replica_reads_its_token_from_the_file_too(
        start_coordinator, secrets, monkeypatch):
    # Its Rounds calls went without a token before: refused by a coordinator that has one.
    import torch

    hub = await start_coordinator(token="job-secret")
    token, _ = secrets
    monkeypatch.delenv("GRADSTAR_TOKEN", raising=False)
    monkeypatch.setenv("GRADSTAR_TOKEN_FILE", str(token))

    def replica() -> list[int]:  # blocking: on a thread, while the hub runs on this loop
        with gradstar.StreamingDiLoCo(torch.nn.Linear(3, 2), sync_every=1, timeout=20,
                                      round_timeout=20, coordinator=hub.address,
                                      job="sdl-file") as sdl:
            sdl.step()
            sdl.finish()
            return sdl.rounds

    assert await asyncio.wait_for(asyncio.to_thread(replica), 60) == [1]


async def test_a_coordinator_with_a_job_secret_and_its_local_shard_take_a_jobs_own_token(
        secrets, tmp_path):
    # From the command line end to end: the coordinator and the local shard it starts read the
    # secret file, the operator prints a job's token offline, and launch hands it to its ranks
    # unchanged; the token opens its own job only.
    _, admin = secrets
    secret = tmp_path / "job-secret"
    secret.write_text("a-job-secret-of-32-characters-xx\n")
    code, printed, err = await run_gradstar("admin", "job-token", "--job", "tf",
                                            "--job-secret-file", str(secret), timeout=30)
    assert code == 0, err
    job_token = tmp_path / "tf-token"
    job_token.write_text(printed)
    proc = await asyncio.create_subprocess_exec(
        *GRADSTAR, "coordinator", "--host", "127.0.0.1", "--port", "0", "--shards", "1",
        "--job-secret-file", str(secret), "--admin-token-file", str(admin),
        "--log-level", "WARNING", env=clean_env(), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    try:
        out = Lines(proc.stdout)
        address = (await out.wait_for(r"listening on (\S+)$", 60))[1]
        await out.wait_for(r"data plane: 1 shards", 10)
        script = str(Path(__file__).with_name("rank_script.py"))
        code, ran, err = await run_gradstar(
            "launch", "--nproc", "2", "--coordinator", address, "--token-file", str(job_token),
            "--job", "tf", script, "sum", timeout=90)
        assert code == 0, err[-3000:]
        assert ran.count('"sum": 3.0') == 2, ran[-3000:]  # both ranks, through the shard
        assert printed.strip() not in ran + err
        code, _, err = await run_gradstar(
            "launch", "--nproc", "1", "--coordinator", address, "--token-file", str(job_token),
            "--job", "other", script, "sum", timeout=90)
        assert code != 0 and "JobAccessError" in err and "not job 'other'" in err, err[-3000:]
    finally:
        await stop_process(proc)


async def test_an_empty_or_short_job_secret_file_is_one_line(tmp_path, secrets):
    _, admin = secrets
    empty, short = tmp_path / "empty", tmp_path / "short"
    empty.write_text("\n")
    short.write_text("guessable\n")
    for command in ("coordinator", "shard"):
        code, _, err = await run_gradstar(command, "--job-secret-file", str(empty),
                                          "--admin-token-file", str(admin), timeout=30)
        assert code == 2 and f"the job secret file {empty} is empty" in err, (command, err)
        code, _, err = await run_gradstar(command, "--job-secret-file", str(short),
                                          "--admin-token-file", str(admin), timeout=30)
        assert code == 2 and "needs at least 16 bytes, got 9" in err, (command, err)
    code, _, err = await run_gradstar("coordinator", "--host", "127.0.0.1",
                                      "--job-secret-file", str(short), timeout=30)
    assert code == 2 and "needs an admin token" in err, err
