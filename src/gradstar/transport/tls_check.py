"""Why a connection that should have worked did not: a TLS handshake done by hand.

gRPC reports every failed handshake as a generic "unavailable" once the connect timeout has
passed. When that happens, :func:`tls_problem` repeats the handshake with Python's ``ssl``
module, with the same CA and client certificate, and turns the outcome into a sentence that
names the likely cause: a certificate that does not chain to the configured CA, one issued for
another host name, a client certificate the server requires, or one side speaking TLS and the
other not. It only diagnoses; it never decides whether to connect.

A rank's channels to the coordinator and to hub shards (:func:`wait_connected`), its peer links,
and a hub shard's channel to its coordinator all wait for their connection through
:func:`connect_or_diagnose`, so each names a TLS mismatch within a second or two.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path

import grpc

from gradstar.errors import CoordinatorUnavailableError

_NOT_TLS = ("wrong version number", "record layer failure", "packet length too long",
            "unknown protocol", "http request")


def _split(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def _handshake(target: str, context: ssl.SSLContext, timeout: float) -> bool:
    """Handshake with ``target``; return whether the server kept the connection open after it.

    Under TLS 1.3 a server refuses a client certificate (or its absence) only after the
    client's side of the handshake is done, so the first read tells: a gRPC server sends its
    HTTP/2 settings at once, a refusing one an alert or nothing before it closes.
    """
    host, port = _split(target)
    with socket.create_connection((host, port), timeout=timeout) as raw:
        with context.wrap_socket(raw, server_hostname=host) as tls:
            tls.settimeout(min(timeout, 1.0))
            try:
                return tls.recv(1) != b""
            except (TimeoutError, ssl.SSLWantReadError):
                return True


def _diagnose(target: str, ca: Path | None, cert: Path | None, key: Path | None,
              timeout: float, ca_setting: str) -> str | None:
    try:
        _split(target)
    except ValueError:  # no HOST:PORT to connect to by hand (a malformed address): no diagnosis
        return None
    if ca is None and cert is None:
        # The client speaks plaintext: does the server speak TLS?
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        probe.check_hostname = False
        probe.verify_mode = ssl.CERT_NONE
        probe.set_alpn_protocols(["h2"])
        try:
            _handshake(target, probe, timeout)
        except (OSError, ssl.SSLError):
            return None
        return (f"{target} serves TLS but this client is configured for plaintext: set "
                f"{ca_setting} ({_env(ca_setting)}) to the CA of its certificate")
    context = ssl.create_default_context(cafile=str(ca) if ca else None)
    context.set_alpn_protocols(["h2"])
    if cert is not None:
        context.load_cert_chain(str(cert), str(key) if key else None)
    try:
        kept_open = _handshake(target, context, timeout)
    except ssl.SSLCertVerificationError as error:
        reason = (error.verify_message or str(error)).lower()
        if "hostname" in reason or "ip address" in reason:
            return (f"the certificate of {target} is not valid for the name "
                    f"{_split(target)[0]!r} ({error.verify_message}): connect by a name or "
                    "address the certificate lists, or reissue it with this one")
        if "expired" in reason or "not yet valid" in reason:
            return f"the certificate of {target} is outside its validity period ({reason})"
        return (f"the certificate of {target} does not chain to the CA in {ca_setting} ({ca}): "
                f"{error.verify_message}")
    except ssl.SSLError as error:
        text = str(error).lower().replace("_", " ")
        if any(s in text for s in _NOT_TLS):
            return (f"{target} does not speak TLS: drop {ca_setting}/tls_cert, or start it with "
                    "--tls-cert and --tls-key")
        if "certificate required" in text or ("handshake failure" in text and cert is None):
            return (f"{target} requires a client certificate (mutual TLS): set tls_cert and "
                    "tls_key (GRADSTAR_TLS_CERT, GRADSTAR_TLS_KEY)")
        if "unknown ca" in text or "bad certificate" in text or "certificate unknown" in text:
            return (f"{target} refused this client's certificate ({cert}): it does not chain "
                    "to the CA the server trusts (its --tls-client-ca)")
        return f"the TLS handshake with {target} failed: {error}"
    except OSError:
        return None  # not reachable at all: not a TLS problem
    if not kept_open:
        if cert is None:
            return (f"{target} closed the connection right after the TLS handshake, as a server "
                    "that requires a client certificate (mutual TLS) does: set tls_cert and "
                    "tls_key (GRADSTAR_TLS_CERT, GRADSTAR_TLS_KEY)")
        return (f"{target} closed the connection right after the TLS handshake: it does not "
                f"accept this client's certificate ({cert}); check that it chains to the "
                "server's --tls-client-ca")
    return None


def _env(setting: str) -> str:
    return f"GRADSTAR_{setting.upper()}"


async def tls_problem(target: str, ca: Path | None, cert: Path | None = None,
                      key: Path | None = None, timeout: float = 3.0, *,
                      ca_setting: str = "tls_ca") -> str | None:
    """A sentence naming why a TLS (or plaintext) connection to ``target`` fails, or None if a
    handshake by hand succeeds or the target does not answer at all. ``ca_setting`` is the name
    of the setting that holds ``ca``, as the sentence tells the reader to change it."""
    return await asyncio.to_thread(_diagnose, target, ca, cert, key, timeout, ca_setting)


#: How long a connection may take before the handshake is also tried by hand.
_PROBE_AFTER = 1.0


async def connect_or_diagnose(channel: grpc.aio.Channel, target: str, timeout: float,
                              ca: Path | None = None, cert: Path | None = None,
                              key: Path | None = None, *,
                              ca_setting: str = "tls_ca") -> str | None:
    """Wait until ``channel`` is connected to ``target``; None once it is.

    A connection not made within a second is also tried by hand (:func:`tls_problem`, with the
    channel's CA, client certificate and key); a TLS problem found that way is returned at
    once, as a sentence naming its cause, instead of waiting out ``timeout``. The caller words
    the error: the same problem means something else for the coordinator, a hub shard or a
    peer.

    Raises:
        TimeoutError: neither connected nor a TLS problem found within ``timeout`` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    ready = asyncio.ensure_future(channel.channel_ready())
    probe: asyncio.Future | None = None
    try:
        while (left := deadline - loop.time()) > 0:
            waits = {ready} if probe is None or probe.done() else {ready, probe}
            wait = left if probe is not None else min(left, _PROBE_AFTER)
            done, _ = await asyncio.wait(waits, timeout=wait,
                                         return_when=asyncio.FIRST_COMPLETED)
            if ready in done:
                ready.result()
                return None
            if probe is None:
                probe = asyncio.ensure_future(tls_problem(
                    target, ca, cert, key, max(0.5, min(left, 3.0)), ca_setting=ca_setting))
            elif probe in done and probe.result() is not None:
                return probe.result()
    finally:
        for future in (ready, probe):
            if future is not None and not future.done():
                future.cancel()
    if probe is not None and probe.done() and probe.result() is not None:
        return probe.result()
    raise TimeoutError(f"not connected to {target} within {timeout:g} s")


async def wait_connected(channel: grpc.aio.Channel, target: str, timeout: float,
                         ca: Path | None = None, cert: Path | None = None,
                         key: Path | None = None, *, name: str | None = None,
                         ca_setting: str = "tls_ca") -> None:
    """Wait until ``channel`` is connected to ``target``, a part of the hub: the coordinator,
    or the hub shard that messages call ``name`` (:func:`connect_or_diagnose`).

    Raises:
        CoordinatorUnavailableError: not connected within ``timeout`` seconds, or at once with
            its cause when a TLS problem was found.
    """
    try:
        problem = await connect_or_diagnose(channel, target, timeout, ca, cert, key,
                                            ca_setting=ca_setting)
    except TimeoutError:
        who = "the coordinator" if name is None else "it"
        raise CoordinatorUnavailableError(
            f"could not reach {name or target} within {timeout:g} s; is {who} running there, "
            "and do TLS settings match?") from None
    if problem is not None:
        raise CoordinatorUnavailableError(f"could not connect to {name or target}: {problem}")
