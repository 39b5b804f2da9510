"""The one way a gradstar gRPC server is built: :func:`serve` (the coordinator's two servers, a
hub shard, a rank's peer server).

Every server installs the token interceptor (:mod:`.auth`), takes its options from
:mod:`.channels` (a bulk server's keepalive tolerates full links), binds with TLS when given
credentials, and reports a failed bind as an ``OSError`` naming the server, rather than gRPC's
``RuntimeError`` or a port of 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import grpc

from .auth import TokenAuthInterceptor
from .channels import BULK_SERVER_OPTIONS, SERVER_OPTIONS, stream_window_options
from .job_tokens import JobSecret

#: What a server serves: a generic handler, or a function that adds a servicer to the server
#: (``functools.partial(add_XServicer_to_server, servicer)``, a health servicer's adder).
Service = grpc.GenericRpcHandler | Callable[[grpc.aio.Server], object]


def serve(address: str, services: Iterable[Service], *, what: str, token: str | None,
          admin_token: str | None = None, credentials: grpc.ServerCredentials | None = None,
          bulk: bool = False, stream_window_bytes: int = 0,
          job_secret: JobSecret | None = None) -> tuple[grpc.aio.Server, int]:
    """A server of ``services`` bound to ``address`` (TLS with ``credentials``), not started
    yet (``await server.start()``, once the caller has everything else in place), and its
    bound port.

    ``token`` / ``admin_token``: what the interceptor asks of every call (None: open).
    ``job_secret``: also admit each job's own token, to its job only (:mod:`.job_tokens`).
    ``bulk``: the server carries tensors (:data:`.channels.BULK_SERVER_OPTIONS`).
    ``stream_window_bytes``: each stream's receive window, fixed (0: gRPC sizes it;
    :func:`.channels.stream_window_options`).

    Raises:
        OSError: ``address`` could not be bound (in use, or no such address here), naming
            ``what``.
    """
    interceptor = TokenAuthInterceptor(token, admin_token, job_secret)
    server = grpc.aio.server(interceptors=[interceptor],
                             options=[*(BULK_SERVER_OPTIONS if bulk else SERVER_OPTIONS),
                                      *stream_window_options(stream_window_bytes)])
    for service in services:
        if isinstance(service, grpc.GenericRpcHandler):
            server.add_generic_rpc_handlers((service,))
        else:
            service(server)
    try:
        port = (server.add_secure_port(address, credentials) if credentials is not None
                else server.add_insecure_port(address))
    except RuntimeError:  # grpc's way of saying the bind failed (in use, no such address)
        port = 0
    if port == 0:
        raise OSError(f"could not bind {what} to {address} (in use, or no such address here)")
    return server, port


__all__ = ["Service", "serve"]
