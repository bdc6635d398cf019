"""Typed errors at the serving boundary, mapped once to HTTP status and gRPC code."""

from __future__ import annotations

import logging
import uuid

import grpc
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from dlite_ray.engine.sequence import InvalidRequest

log = logging.getLogger(__name__)
MAX_ERROR_CHARS = 1024


class ServeError(Exception):
    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL
    error_type = "server_error"


class InternalError(ServeError):
    """Anything that is not a client error: the client sees only its id."""

    def __init__(self, message: str, error_id: str):
        super().__init__(message)
        self.error_id = error_id


class BadRequest(ServeError):
    http_status, grpc_code, error_type = 400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error"


class PayloadTooLarge(ServeError):
    http_status, grpc_code, error_type = 413, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error"


class Unauthenticated(ServeError):
    http_status, grpc_code, error_type = 401, grpc.StatusCode.UNAUTHENTICATED, "authentication_error"


class Forbidden(ServeError):
    """A valid key that may not use this endpoint (operational figures, when limited to some tenants)."""

    http_status, grpc_code, error_type = 403, grpc.StatusCode.PERMISSION_DENIED, "permission_error"


class ConversationNotFound(ServeError):
    http_status, grpc_code, error_type = 404, grpc.StatusCode.NOT_FOUND, "not_found_error"


class ConversationBusy(ServeError):
    http_status, grpc_code, error_type = 409, grpc.StatusCode.ABORTED, "conflict_error"


class Overloaded(ServeError):
    http_status, grpc_code, error_type = 429, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limit_error"


class QuotaExceeded(ServeError):
    """A tenant at one of its stored-state caps (live conversations, stored history bytes):
    the message names the limit. Freed by deleting conversations, not by waiting."""

    http_status, grpc_code, error_type = 429, grpc.StatusCode.RESOURCE_EXHAUSTED, "insufficient_quota"


class OutputFailed(ServeError):
    """The reply could not go on under the request's output grammar (a schema or tool call
    too complex for the matcher, found mid-reply): an error, never a "stop" that would
    claim the reply is JSON the schema accepts."""

    http_status, grpc_code, error_type = 422, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error"

    def __init__(self, message: str, replica: str | None = None):
        super().__init__(message)
        self.replica = replica  # where the failed reply ran (its KV is pinned there under a lease)


class ReplicaUnavailable(ServeError):
    """The replica serving the request died or was drained mid-request: retry (a
    conversation's next turn re-prefills elsewhere from its durable history)."""

    http_status, grpc_code, error_type = 503, grpc.StatusCode.UNAVAILABLE, "service_unavailable"


class StoreUnavailable(ServeError):
    """The conversation store (a PostgreSQL server) did not answer: retry. A write whose
    commit got no answer may have landed; a retry under the same idempotency key finds out."""

    http_status, grpc_code, error_type = 503, grpc.StatusCode.UNAVAILABLE, "service_unavailable"


def unwrap(exc: Exception) -> Exception:
    """Ray wraps replica exceptions; find the typed cause for the status mapping."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else exc


def as_serve_error(exc: Exception) -> ServeError:
    """The typed error a client sees. Only client errors (ServeError's kin, the engine's
    InvalidRequest) say what went wrong; anything else (a ValueError from a checkpoint, a
    bug) is a 500 whose body names only an error id, logged here with the traceback."""
    exc = unwrap(exc)
    if isinstance(exc, ServeError):
        return exc
    if isinstance(exc, InvalidRequest):
        return BadRequest(str(exc))
    if isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError)):
        return ReplicaUnavailable("the serving replica went away mid-request; retry")
    error_id = uuid.uuid4().hex[:16]
    log.error("internal error %s", error_id, exc_info=exc)
    return InternalError(f"internal error (id {error_id}); the server's log has the details", error_id)


def error_message(err: ServeError) -> str:
    """The message a client sees, cut to MAX_ERROR_CHARS: an error that quotes the request (an
    id, a name) must not grow with it (gRPC status details travel in metadata, capped near 16 KB)."""
    message = str(err)
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS - 3] + "..."


def openai_error_body(err: ServeError) -> dict:
    body = {"message": error_message(err), "type": err.error_type, "code": err.http_status}
    if isinstance(err, InternalError):
        body["id"] = err.error_id
    return {"error": body}
