"""A TLS mismatch fails with its cause named, not a generic "unavailable" after the timeout.

Real coordinators with TLS on 127.0.0.1:0 (127.0.0.2 for the host-name case: the throwaway
certificate lists only localhost and 127.0.0.1). Every case uses a 10 s connect timeout and
expects the message of the early check ("could not connect to ..."), which comes from the
handshake done by hand, not from the timeout ("could not reach ... within").
"""

from __future__ import annotations

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
