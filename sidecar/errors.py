"""Errors that map onto the wire error envelope: {"error": {"type", "message", "field"}}."""

from __future__ import annotations


class SidecarError(Exception):
    status = 500
    type = "internal_error"

    def __init__(self, message: str, field: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.retry_after = retry_after

    def to_wire(self) -> dict:
        return {"error": {"type": self.type, "message": self.message, "field": self.field}}


class ProtocolError(SidecarError):
    """Malformed body, schema or semantic violation (the call changed nothing)."""

    status = 400
    type = "invalid_request"


class StateError(SidecarError):
    """The call is not allowed in the current lifecycle state."""

    status = 409
    type = "invalid_state"


class Unavailable(SidecarError):
    """Busy, sleeping, unhealthy or shutting down; retry later."""

    status = 503
    type = "unavailable"


class PayloadTooLarge(SidecarError):
    status = 413
    type = "payload_too_large"


class UnsupportedMediaType(SidecarError):
    status = 415
    type = "unsupported_media_type"


class Unauthorized(SidecarError):
    status = 401
    type = "unauthorized"


class UnknownMethod(SidecarError):
    status = 404
    type = "unknown_method"


class MethodNotAllowed(SidecarError):
    status = 405
    type = "method_not_allowed"


class StartupError(Exception):
    """A configuration the server refuses to start with; the message says what to do."""


class ClientClosed(SidecarError):
    """The client hung up before its request body arrived (nginx's 499): nothing ran."""

    status = 499
    type = "client_closed_request"
