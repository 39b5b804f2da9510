"""What both halves of the coordinator's peer relay agree on (the hub's half is
``gradstar.coordinator.rendezvous.relay``, the rank's ``gradstar.client.peer.relay``): the
call metadata that names a relay call's caller and role, and the listener's notices."""

from __future__ import annotations

import struct

from gradstar.errors import ProtocolError
from gradstar.transport.addresses import split_host_port

#: Call metadata naming the caller and the other end: (job, generation, rank, member id, role,
#: peer rank). The job travels as UTF-8 bytes (a "-bin" key: a job name need not be ASCII).
RELAY_KEYS = ("gradstar-relay-job-bin", "gradstar-relay-generation", "gradstar-relay-rank",
              "gradstar-relay-member", "gradstar-relay-role", "gradstar-relay-peer")
_NOTICE = struct.Struct(">I")
_PUNCH = struct.Struct(">IH")


def relay_metadata(job: str, generation: int, rank: int, member_id: str, role: str,
                   peer: int = -1) -> tuple[tuple[str, str], ...]:
    """The metadata a relay call carries (the rank's half: ``gradstar.client.peer.relay``)."""
    values = (job.encode(), str(generation), str(rank), member_id, role, str(peer))
    return tuple(zip(RELAY_KEYS, values, strict=True))


def caller(metadata) -> tuple[str, int, int, str, str, int]:
    """(job, generation, rank, member id, role, peer) from a relay call's metadata.

    Raises:
        ProtocolError: a key missing or malformed.
    """
    given = {k: v for k, v in metadata or () if k in RELAY_KEYS}
    try:
        job, generation, rank, member, role, peer = (given[k] for k in RELAY_KEYS)
        return (bytes(job).decode(), int(generation), int(rank), member, role, int(peer))
    except (KeyError, ValueError, TypeError):
        raise ProtocolError("a relay call names its job, generation, rank, member id, role "
                            "and peer in its metadata") from None


def caller_host(peer: str | None) -> str:
    """The host of grpc's ``ipv4:HOST:PORT`` / ``ipv6:[HOST]:PORT`` peer string ('' for
    anything else, such as a Unix socket)."""
    kind, _, rest = (peer or "").partition(":")
    return split_host_port(rest)[0] if kind in ("ipv4", "ipv6") else ""


def notice(src: int) -> bytes:
    """What the hub writes on a listener: the rank that wants a stream to it."""
    return _NOTICE.pack(src)


def punch_notice(src: int, host: str, port: int) -> bytes:
    """What the hub writes on a listener for NAT traversal: rank ``src`` is punching towards
    it from ``host``:``port`` (dial it back from the punch port)."""
    return _PUNCH.pack(src, port) + host.encode()


def read_notice(frame: bytes) -> tuple[int, str, int]:
    """(sender rank, host, port) of a listener's frame: host '' for a relayed stream to
    accept, else where to punch back to.

    Raises:
        ProtocolError: not a notice.
    """
    if len(frame) == _NOTICE.size:
        return _NOTICE.unpack(frame)[0], "", 0
    if _PUNCH.size < len(frame) <= _PUNCH.size + 256:
        src, port = _PUNCH.unpack_from(frame)
        try:
            return src, bytes(frame[_PUNCH.size:]).decode(), port
        except UnicodeDecodeError:
            pass
    raise ProtocolError(f"a relay notice is {_NOTICE.size} bytes, or a punch notice "
                        f"{_PUNCH.size} + a host; got {len(frame)}")


__all__ = ["RELAY_KEYS", "caller", "caller_host", "notice", "punch_notice", "read_notice",
           "relay_metadata"]
