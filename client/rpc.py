"""Channels to the coordinator and translation of gRPC failures into gradstar errors."""

from __future__ import annotations

import grpc

from gradstar.channels import client_credentials, secure_or_insecure_channel
from gradstar.config import ClientSettings
from gradstar.errors import (
    ERROR_FIELDS_KEY,
    ERROR_NAME_KEY,
    AuthenticationError,
    CollectiveTimeoutError,
    CoordinatorUnavailableError,
    GradstarError,
    PayloadTooLargeError,
    error_from_wire,
)

AUTH_KEY = "authorization"


def open_channel(settings: ClientSettings) -> grpc.aio.Channel:
    """A channel to the coordinator, with TLS when a CA or client certificate is configured."""
    tls = settings.tls_ca or settings.tls_cert
    creds = (client_credentials(settings.tls_ca, settings.tls_cert, settings.tls_key)
             if tls else None)
    return secure_or_insecure_channel(settings.coordinator, creds)


def call_metadata(settings: ClientSettings) -> tuple[tuple[str, str], ...]:
    if settings.token is None:
        return ()
    return ((AUTH_KEY, f"Bearer {settings.token.get_secret_value()}"),)


def _trailing(error: grpc.RpcError) -> dict:
    try:
        return dict(error.trailing_metadata() or ())
    except Exception:  # a locally failed call may have no metadata at all
        return {}


def is_coordinator_verdict(error: grpc.RpcError) -> bool:
    """Whether the coordinator itself named the error (rather than the transport failing)."""
    return ERROR_NAME_KEY in _trailing(error)


def error_from_rpc(error: grpc.RpcError, what: str, target: str) -> GradstarError:
    """The gradstar error a failed call stands for; the coordinator's own errors keep their type."""
    trailing = _trailing(error)
    details = error.details() or ""
    if ERROR_NAME_KEY in trailing:
        return error_from_wire(trailing[ERROR_NAME_KEY], trailing.get(ERROR_FIELDS_KEY), details)
    code = error.code()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(f"the coordinator at {target} refused {what}: {details}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return CoordinatorUnavailableError(
            f"lost the coordinator at {target} during {what}: {details or code.name}"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return CollectiveTimeoutError(f"{what} got no answer from {target} before its deadline")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return PayloadTooLargeError(f"{what} was refused by {target}: {details}")
    return GradstarError(f"{what} failed at {target}: {code.name}: {details}")
