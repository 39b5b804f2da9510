"""A GET-only HTTP/1.1 endpoint: the coordinator's /metrics and the worker agent's /healthz."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

#: (status code, content type, body) for a request path.
Handler = Callable[[], Awaitable[tuple[int, str, bytes]]]
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
_HEADER_LIMIT = 16 * 1024
_READ_TIMEOUT = 5.0


async def serve_http(host: str, port: int, routes: dict[str, Handler]) -> asyncio.Server:
    """Serve ``GET``/``HEAD`` of ``routes`` (path -> handler) over HTTP/1.1, one request per
    connection; also used by the worker agent's ``/healthz``. Close it with ``server.close()``.

    Raises:
        OSError: the address could not be bound.
    """

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT)
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            method, _, rest = request_line.partition(" ")
            path = rest.partition(" ")[0].split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, kind, body = 405, "text/plain; charset=utf-8", b"only GET and HEAD\n"
            elif path in routes:
                status, kind, body = await routes[path]()
            else:
                known = ", ".join(sorted(routes))
                status, kind, body = 404, "text/plain; charset=utf-8", f"try {known}\n".encode()
            writer.write(
                f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode("latin-1")
                + (body if method != "HEAD" else b""))
            await asyncio.wait_for(writer.drain(), _READ_TIMEOUT)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError):
            pass  # a client that went away or sent garbage gets nothing
        except Exception:
            log.exception("HTTP endpoint handler failed")
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), _READ_TIMEOUT)

    return await asyncio.start_server(handle, host, port, limit=_HEADER_LIMIT)


def bound_port(server: asyncio.Server) -> int:
    return server.sockets[0].getsockname()[1]
