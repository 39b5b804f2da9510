"""Whether a server can listen on an address, said in one line a user can act on.

gRPC reports a failed bind as ``RuntimeError: Failed to bind`` after its C core has logged the
cause; asyncio's servers raise an ``OSError`` naming the errno. The commands check the address
themselves first (:func:`bind_problem`), the way the server will bind it, and turn either
failure into the same advice (:func:`describe_bind_error`). The check leaves a window in which
another process may take the port; the server's own bind still fails cleanly then.
"""

from __future__ import annotations

import errno
import socket


def describe_bind_error(error: OSError, host: str, port: int, flag: str = "--port") -> str:
    """What ``error`` (from binding ``host:port``) means and what to do, in one line.

    ``flag`` names the option that chose the port (``--port``, ``--metrics-port``, ...).
    """
    shown = f"[{host}]" if ":" in host else host
    if isinstance(error, socket.gaierror):
        return (f"cannot resolve --host {host!r} ({error.strerror}); give an address of this "
                "machine, 127.0.0.1 for this machine only, or 0.0.0.0 for every interface")
    if error.errno == errno.EADDRINUSE:
        return (f"{shown}:{port} is already in use (another process listens there); stop "
                f"it or choose another {flag} (0 picks a free one)")
    if error.errno == errno.EADDRNOTAVAIL:
        return (f"{host} is not an address of this machine, so nothing can listen on it; use "
                "one of its addresses, 127.0.0.1 for this machine only, or 0.0.0.0 for every "
                "interface")
    if error.errno == errno.EACCES:
        return (f"no permission to listen on port {port} (ports below 1024 need root); choose "
                f"another {flag} above 1023")
    return f"cannot listen on {shown}:{port}: {error.strerror or error}"


def bind_problem(host: str, port: int, flag: str = "--port") -> str | None:
    """Why ``host:port`` cannot be listened on (see :func:`describe_bind_error`), or None.

    Binds (without listening) a socket to every address ``host`` resolves to, with
    ``SO_REUSEADDR`` as gRPC and asyncio servers set it, so that a port in ``TIME_WAIT`` is no
    problem and one that something listens on is. Like gRPC, one address that binds is enough.
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        return describe_bind_error(error, host, port, flag)
    first: OSError | None = None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as error:
                first = first or error
                continue
        return None
    return describe_bind_error(first, host, port, flag) if first else None
