"""A TLS mismatch fails with its cause named, not a generic "unavailable" after the timeout.

Real coordinators with TLS on 127.0.0.1:0 (127.0.0.2 for the host-name case: the throwaway
certificate lists only localhost and 127.0.0.1), real ``gradstar shard`` processes and real peer
servers. Every case uses a 10 s connect timeout (20 s for a shard's wait for its coordinator)
and expects the message of the early check ("could not connect to ..."), which comes from the
handshake done by hand, not from the timeout ("could not reach ... within"), and well before
that timeout. The same check guards a rank's channel to the coordinator, its channels to hub
shards, its peer links, and a shard's channel to its coordinator.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import numpy as np
import pytest

import gradstar
from gradstar import errors

from .certs import make_pki


@pytest.fixture
def pki(tmp_path):
    (tmp_path / "pki").mkdir()
    return make_pki(tmp_path / "pki")


@pytest.fixture
def other_pki(tmp_path):
    (tmp_path / "other").mkdir()
    return make_pki(tmp_path / "other")


async def connect(address: str, **tls):
    return await gradstar.init_process_group_async(
        coordinator=address, job="tls", world_size=1, connect_timeout=10, **tls)


async def test_a_certificate_from_another_ca_is_named(start_coordinator, pki, other_pki):
    hub = await start_coordinator(tls_cert=pki["server"], tls_key=pki["server_key"])
    with pytest.raises(errors.CoordinatorUnavailableError) as failed:
        await connect(hub.address, tls_ca=other_pki["ca"])
    message = str(failed.value)
    assert message.startswith(f"could not connect to {hub.address}: ")
    assert "does not chain to the CA in tls_ca" in message and str(other_pki["ca"]) in message


async def test_a_host_name_the_certificate_does_not_list_is_named(start_coordinator, pki):
    hub = await start_coordinator(host="127.0.0.2", tls_cert=pki["server"],
                                  tls_key=pki["server_key"])
    with pytest.raises(errors.CoordinatorUnavailableError) as failed:
        await connect(hub.address, tls_ca=pki["ca"])
    assert "is not valid for the name '127.0.0.2'" in str(failed.value)


async def test_a_missing_client_certificate_is_named(start_coordinator, pki):
    hub = await start_coordinator(tls_cert=pki["server"], tls_key=pki["server_key"],
                                  tls_client_ca=pki["ca"])
    with pytest.raises(errors.CoordinatorUnavailableError) as failed:
        await connect(hub.address, tls_ca=pki["ca"])
    assert "requires a client certificate (mutual TLS)" in str(failed.value)
    assert "set tls_cert and tls_key" in str(failed.value)
    assert str(failed.value).startswith(f"could not connect to {hub.address}: ")


async def test_plaintext_against_tls_and_tls_against_plaintext_are_named(start_coordinator,
                                                                          pki):
    tls_hub = await start_coordinator(tls_cert=pki["server"], tls_key=pki["server_key"])
    with pytest.raises(errors.CoordinatorUnavailableError) as failed:
        await connect(tls_hub.address)
    assert "serves TLS but this client is configured for plaintext" in str(failed.value)
    plain_hub = await start_coordinator()
    with pytest.raises(errors.CoordinatorUnavailableError) as failed:
        await connect(plain_hub.address, tls_ca=pki["ca"])
    assert "does not speak TLS" in str(failed.value)


async def test_a_matching_configuration_still_connects(start_coordinator, pki):
    hub = await start_coordinator(tls_cert=pki["server"], tls_key=pki["server_key"],
                                  tls_client_ca=pki["ca"])
    group = await connect(hub.address, tls_ca=pki["ca"], tls_cert=pki["client"],
                          tls_key=pki["client_key"])
    await group.close()


# -- peer links, hub shards, and a shard's own channel to its coordinator ----------------------

#: Well under every connect timeout here: the early check answers in about a second.
PROMPT = 6.0


async def join(address: str, job: str, *tls_by_rank: dict, return_exceptions=False):
    """One rank of ``job`` per dict of TLS options in ``tls_by_rank``, in rank order."""
    return await asyncio.wait_for(asyncio.gather(*(
        gradstar.init_process_group_async(coordinator=address, job=job,
                                          world_size=len(tls_by_rank), rank=r, connect_timeout=10,
                                          timeout=20, join_timeout=20, **tls)
        for r, tls in enumerate(tls_by_rank)), return_exceptions=return_exceptions), 30)


async def test_a_peer_server_with_a_certificate_from_another_ca_is_named(start_coordinator, pki,
                                                                          other_pki):
    hub = await start_coordinator(tls_cert=pki["server"], tls_key=pki["server_key"])
    # Rank 1 serves its peer streams with a certificate of another CA, which rank 0 does not
    # trust; rank 0's server requires client certificates from its CA, which rank 1's is not.
    zero, one = await join(
        hub.address, "tls-peers",
        dict(tls_ca=pki["ca"], tls_cert=pki["server"], tls_key=pki["server_key"]),
        dict(tls_ca=pki["ca"], tls_cert=other_pki["server"], tls_key=other_pki["server_key"]))
    try:
        started = time.monotonic()
        with pytest.raises(errors.ConfigurationError) as failed:
            await zero.send(np.ones(3), 1)
        assert time.monotonic() - started < PROMPT
        server = one.peers[1]
        assert str(failed.value).startswith(
            f"rank 0 could not connect to rank 1's peer server at {server}: the certificate of "
            f"{server} does not chain to the CA in tls_ca ({pki['ca']})")
        started = time.monotonic()
        with pytest.raises(errors.ConfigurationError) as failed:
            await one.send(np.ones(3), 0)
        assert time.monotonic() - started < PROMPT
        assert f"could not connect to rank 0's peer server at {zero.peers[0]}: " in str(
            failed.value)
        assert "this client's certificate" in str(failed.value)
    finally:
        await asyncio.wait_for(asyncio.gather(zero.close(), one.close()), 20)


async def start_shard(coordinator: str, *args: str, **env: str) -> asyncio.subprocess.Process:
    """``gradstar shard`` on 127.0.0.1 for ``coordinator``, with ``args`` and ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gradstar", "shard", "--coordinator", coordinator,
        "--host", "127.0.0.1", "--port", "0", *args, env={**base, **env},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)


async def test_a_hub_shard_with_a_certificate_from_another_ca_is_named(start_coordinator, pki,
                                                                        other_pki):
    hub = await start_coordinator(tls_cert=pki["server"], tls_key=pki["server_key"])
    # The shard trusts the coordinator, but serves ranks a certificate they cannot verify.
    shard = await start_shard(hub.address, "--tls-cert", str(other_pki["server"]),
                              "--tls-key", str(other_pki["server_key"]),
                              "--coordinator-ca", str(pki["ca"]))
    try:
        deadline = time.monotonic() + 30
        while not hub.shards.up:
            assert time.monotonic() < deadline and shard.returncode is None, "no shard came up"
            await asyncio.sleep(0.05)
        address = hub.shards.up[0].address
        started = time.monotonic()
        outcomes = await join(hub.address, "tls-shard", dict(tls_ca=pki["ca"]),
                              dict(tls_ca=pki["ca"]), return_exceptions=True)
        elapsed = time.monotonic() - started
        await asyncio.wait_for(asyncio.gather(*(
            o.close() for o in outcomes if not isinstance(o, BaseException))), 20)
        # Joining reaches the generation's shards as it reaches the coordinator: every rank is
        # told at once what is wrong with the shard's certificate.
        for failed in outcomes:
            assert isinstance(failed, errors.CoordinatorUnavailableError), failed
            assert str(failed).startswith(
                f"could not connect to hub shard 0 at {address}: the certificate of {address} "
                f"does not chain to the CA in tls_ca ({pki['ca']})"), failed
        assert elapsed < PROMPT
    finally:
        shard.kill()
        await asyncio.wait_for(shard.communicate(), 10)


@pytest.mark.parametrize("trust", ["another CA", "plaintext"])
async def test_a_shard_that_cannot_verify_its_coordinator_says_why(start_coordinator, pki,
                                                                    other_pki, trust):
    hub = await start_coordinator(tls_cert=pki["server"], tls_key=pki["server_key"])
    args = ["--tls-cert", str(pki["server"]), "--tls-key", str(pki["server_key"])]
    if trust == "another CA":
        args += ["--coordinator-ca", str(other_pki["ca"])]
    started = time.monotonic()
    shard = await start_shard(hub.address, *args, GRADSTAR_SHARD_WAIT="20")
    try:
        _, err = await asyncio.wait_for(shard.communicate(), 30)
    finally:
        if shard.returncode is None:
            shard.kill()
            await asyncio.wait_for(shard.communicate(), 10)
    assert time.monotonic() - started < 15  # the early check, not the 20 s wait
    assert shard.returncode == 1
    line = err.decode().strip().splitlines()[-1]
    prefix = f"gradstar shard: could not connect to {hub.address}: "
    if trust == "another CA":
        assert line.startswith(prefix + f"the certificate of {hub.address} does not chain to "
                                        f"the CA in coordinator_ca ({other_pki['ca']})"), line
    else:
        assert line == prefix + (f"{hub.address} serves TLS but this client is configured for "
                                 "plaintext: set coordinator_ca (GRADSTAR_COORDINATOR_CA) to "
                                 "the CA of its certificate"), line
    assert not hub.shards.slots


async def test_an_address_the_check_cannot_parse_still_fails_as_unavailable():
    # The handshake by hand needs HOST:PORT; an address without one (a stray character after
    # the port) must end in the named error, not in a ValueError from the check.
    with pytest.raises(errors.CoordinatorUnavailableError) as failed:
        await gradstar.init_process_group_async(
            coordinator="127.0.0.1:1)", job="tls", world_size=1, connect_timeout=2)
    assert "127.0.0.1:1)" in str(failed.value)
