"""The election over TLS: a real etcd serving https:// with a throwaway CA's certificate and
taking only clients with a certificate of that CA (``--client-cert-auth``); coordinators given
``--ha-ca``, ``--ha-cert`` and ``--ha-key`` elect a leader through it and a standby takes over
from a killed one. Without the CA, or with a CA that did not sign etcd's certificate, a
coordinator fails at start by name (ElectionUnavailableError), never a hang or a plain-text
call."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

import pytest

from benchmarks._etcd import start_etcd, stop_etcd

from .certs import make_pki
from .conftest import next_line, spawn_standby

pytestmark = pytest.mark.timeout(120)


@contextlib.asynccontextmanager
async def tls_etcd(tmp_path):
    """etcd over TLS; its URL and the PKI (ca, server, client: certs and keys)."""
    pki = make_pki(tmp_path)
    proc, url = await asyncio.to_thread(start_etcd, tmp_path, 20.0, pki)
    try:
        yield url, pki
    finally:
        await asyncio.to_thread(stop_etcd, proc)


async def test_coordinators_elect_a_leader_through_etcd_over_tls_and_a_standby_takes_over(
        tmp_path):
    async with tls_etcd(tmp_path) as (url, pki):
        flags = ("--ha-ttl", "2", "--ha-ca", str(pki["ca"]), "--ha-cert", str(pki["client"]),
                 "--ha-key", str(pki["client_key"]))
        hubs = [await spawn_standby(url, *flags) for _ in range(2)]
        try:
            assert [role for _, _, role in hubs] == ["leader", "standby"]
            hubs[0][0].send_signal(signal.SIGKILL)
            await hubs[0][0].wait()
            line = await asyncio.wait_for(
                next_line(hubs[1][0], "gradstar coordinator listening on "), 30)
            assert line.split()[-1] == hubs[1][1]
        finally:
            for proc, _, _ in hubs:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGKILL)
                await proc.wait()


async def test_a_coordinator_without_the_right_ca_or_certificate_is_refused_by_name(tmp_path):
    async with tls_etcd(tmp_path) as (url, pki):
        (tmp_path / "other").mkdir()
        other = make_pki(tmp_path / "other")  # a CA that did not sign etcd's certificate
        cases = (
            ((), "ElectionUnavailableError: no etcd endpoint of 127.0.0.1:"),  # plain HTTP
            (("--ha-ca", str(other["ca"]), "--ha-cert", str(pki["client"]), "--ha-key",
              str(pki["client_key"])), "CERTIFICATE_VERIFY_FAILED"),  # etcd not trusted
            (("--ha-ca", str(pki["ca"])),  # no client certificate: etcd refuses the handshake
             "ElectionUnavailableError: no etcd endpoint"),
            (("--ha-ca", str(tmp_path / "missing.pem")), "ConfigurationError: --ha-ca"),
        )
        for flags, named in cases:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gradstar", "coordinator", "--host", "127.0.0.1",
                "--port", "0", "--shards", "0", "--ha", url, *flags,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 40)
            assert proc.returncode == 1, (flags, err.decode()[-2000:])
            assert named in err.decode(), (flags, err.decode()[-2000:])
            assert b"listening on" not in out and b"standby on" not in out
