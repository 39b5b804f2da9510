"""The few etcd v3 calls an election needs, over etcd's JSON gateway (HTTP/1.1, the standard
library); no I/O policy beyond one bounded request per call.

etcd serves every v3 RPC as ``POST /v3/<service>/<method>`` with the protobuf message as JSON
(bytes fields base64, 64-bit integers as strings): documented for etcd 3.4 and later
("gRPC gateway"). We use it instead of a client library because the one Python library with
a v3 API, ``etcd3``, is unmaintained since 2020 and pins protobuf 3 / grpcio stubs of its own,
which clash with this project's generated stubs (protobuf 5); the gateway needs nothing new.

The calls, each one request (``lease/keepalive`` is a stream in gRPC; one message posted
gets its one answer):

- :meth:`Etcd.grant` a lease of ``ttl`` seconds (its id);
- :meth:`Etcd.keepalive` renew it (the TTL left; 0 once etcd has let it expire);
- :meth:`Etcd.create` put a key bound to a lease only if it does not exist (one ``kv/txn``);
- :meth:`Etcd.get`, :meth:`Etcd.count` (a prefix), :meth:`Etcd.put`, :meth:`Etcd.revoke`.

Over TLS (``--ha-ca``: etcd serving ``https://`` with ``--cert-file``), etcd's certificate is
checked against that CA and the endpoint's host name; with ``--ha-cert``/``--ha-key`` the
coordinator presents its own (etcd's ``--client-cert-auth``). A failed handshake is an
unreachable endpoint: the next is tried, and the error names what failed.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from gradstar.errors import ConfigurationError, ElectionUnavailableError

log = logging.getLogger(__name__)

#: Seconds one gateway request may take: an election's calls are tiny, and a member that does
#: not answer within this is as good as unreachable (the next endpoint is tried).
REQUEST_TIMEOUT = 2.0


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _text(b64: str) -> str:
    return base64.b64decode(b64).decode()


def _prefix_end(prefix: str) -> str:
    """The range end that makes ``prefix`` a prefix query (etcd's rule: last byte plus one)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd holds it: its value, the revision that created it, its lease."""

    value: str
    create_revision: int
    lease: int


@dataclass(frozen=True)
class Created:
    """The answer to :meth:`Etcd.create`: whether this call made the key, the key as it is
    now (ours, or the one that was there), and the store's revision."""

    made: bool
    kv: KeyValue | None
    revision: int


def endpoints_of(url: str) -> tuple[list[str], str]:
    """``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]``: the gateway endpoints (``host:port``) and
    the key prefix of the election (default ``/gradstar``).

    Raises:
        ConfigurationError: not an etcd:// URL, or one without a host and port.
    """
    parts = urlsplit(url)
    if parts.scheme != "etcd" or not parts.netloc:
        raise ConfigurationError(
            f"--ha {url!r}: expected etcd://HOST:PORT[,HOST:PORT...][/PREFIX], the client URL "
            "of the etcd cluster that elects the leader")
    endpoints = [e.strip() for e in parts.netloc.split(",") if e.strip()]
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigurationError(
                f"--ha {url!r}: endpoint {endpoint!r} is not HOST:PORT")
    prefix = parts.path.rstrip("/") or "/gradstar"
    return endpoints, prefix


def tls_context(ca: Path, cert: Path | None = None, key: Path | None = None,
                ) -> ssl.SSLContext:
    """The TLS context of a gateway client: etcd's certificate checked against ``ca`` (and
    its host name), this coordinator's own certificate ``cert``/``key`` presented when given
    (etcd's ``--client-cert-auth``).

    Raises:
        ConfigurationError: a file cannot be read or is not PEM of the right kind.
    """
    try:
        context = ssl.create_default_context(cafile=str(ca))
        if cert is not None:
            context.load_cert_chain(str(cert), None if key is None else str(key))
    except (OSError, ssl.SSLError) as error:
        raise ConfigurationError(
            f"--ha-ca {ca}, --ha-cert {cert}, --ha-key {key}: cannot use them for TLS to etcd "
            f"({error})") from None
    return context


class Etcd:
    """A blocking client of the gateway at ``endpoints`` (tried in turn: the first that
    answers serves the call), over TLS when given a ``tls`` context (:func:`tls_context`:
    ``https://`` gateways). Call it from a thread (``asyncio.to_thread``)."""

    def __init__(self, endpoints: list[str], timeout: float = REQUEST_TIMEOUT,
                 tls: ssl.SSLContext | None = None) -> None:
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.tls = tls

    def call(self, path: str, body: dict) -> dict:
        """POST ``body`` to ``/v3/<path>`` on the first endpoint that answers.

        Raises:
            ElectionUnavailableError: no endpoint answered, or what answered is not etcd.
        """
        problems = []
        for endpoint in self.endpoints:
            host, _, port = endpoint.rpartition(":")
            connection = (
                http.client.HTTPConnection(host.strip("[]"), int(port), timeout=self.timeout)
                if self.tls is None else
                http.client.HTTPSConnection(host.strip("[]"), int(port), timeout=self.timeout,
                                            context=self.tls))
            try:
                connection.request("POST", f"/v3/{path}", json.dumps(body),
                                   {"Content-Type": "application/json"})
                response = connection.getresponse()
                text = response.read()
            except (OSError, http.client.HTTPException) as error:
                problems.append(f"{endpoint}: {error}")
                continue
            finally:
                connection.close()
            try:
                answer = json.loads(text)
            except ValueError:
                answer = None
            if response.status != 200 or not isinstance(answer, dict):
                raise ElectionUnavailableError(
                    f"etcd at {endpoint} answered /v3/{path} with HTTP {response.status}: "
                    f"{text[:200]!r}; is it etcd 3.4 or later with its JSON gateway?")
            return answer
        raise ElectionUnavailableError(
            f"no etcd endpoint of {', '.join(self.endpoints)} answered /v3/{path} within "
            f"{self.timeout:g} s: {'; '.join(problems)}")

    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its id."""
        return int(self.call("lease/grant", {"TTL": ttl})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; the TTL etcd gives it now (0: it expired, or was revoked)."""
        result = self.call("lease/keepalive", {"ID": str(lease)}).get("result", {})
        return int(result.get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """End ``lease`` now (its keys go at once); one that is already gone is no error."""
        try:
            self.call("lease/revoke", {"ID": str(lease)})
        except ElectionUnavailableError as error:
            if "lease not found" not in str(error):
                raise

    def create(self, key: str, value: str, lease: int) -> Created:
        """Put ``key`` = ``value`` bound to ``lease`` if no such key exists, in one
        transaction; otherwise read the key that is there."""
        answer = self.call("kv/txn", {
            "compare": [{"key": _b64(key), "result": "EQUAL", "target": "CREATE",
                         "create_revision": "0"}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value),
                                         "lease": str(lease)}}],
            "failure": [{"request_range": {"key": _b64(key)}}],
        })
        revision = int(answer["header"]["revision"])
        if answer.get("succeeded"):
            return Created(True, KeyValue(value, revision, lease), revision)
        kvs = answer["responses"][0]["response_range"].get("kvs", [])
        return Created(False, _kv(kvs[0]) if kvs else None, revision)

    def get(self, key: str) -> KeyValue | None:
        """``key`` as etcd holds it now, or None."""
        kvs = self.call("kv/range", {"key": _b64(key)}).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def put(self, key: str, value: str) -> None:
        self.call("kv/put", {"key": _b64(key), "value": _b64(value)})

    def count(self, prefix: str) -> int:
        """How many keys start with ``prefix``."""
        answer = self.call("kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix),
                                        "count_only": True})
        return int(answer.get("count", 0))


def _kv(kv: dict) -> KeyValue:
    return KeyValue(_text(kv.get("value", "")), int(kv.get("create_revision", 0)),
                    int(kv.get("lease", 0)))


__all__ = ["REQUEST_TIMEOUT", "Created", "Etcd", "KeyValue", "endpoints_of", "tls_context"]
