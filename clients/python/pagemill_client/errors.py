"""Typed exceptions, chosen from the server's `error_type` (then the HTTP status).

TGI routes answer `{error, error_type}`; the OpenAI routes answer
`{"error": {message, type, param, code}}` whose `code` is the same `error_type`."""

from __future__ import annotations


class PagemillError(Exception):
    """Any error response; `status` is None for errors inside a stream."""

    def __init__(self, message: str, error_type: str | None = None, status: int | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.message = message
        self.error_type = error_type
        self.status = status
        self.param = param  # the request field at fault (OpenAI routes), when there is one


class ValidationError(PagemillError):
    """422 (TGI routes) or 400 (OpenAI routes): the request was invalid (parameters, JSON,
    token limits, chat template, a field the route does not accept)."""


class OverloadedError(PagemillError):
    """429: more concurrent requests than the server accepts; retry later."""


class GenerationError(PagemillError):
    """424: a model shard failed while generating."""


class UnhealthyError(PagemillError):
    """503: the server or its shards are not ready."""


class AuthenticationError(PagemillError):
    """401: missing or wrong API key."""


class NotFoundError(PagemillError):
    """404: unknown route."""


_BY_TYPE = {
    "validation": ValidationError,
    "invalid_json": ValidationError,
    "payload_too_large": ValidationError,
    "overloaded": OverloadedError,
    "queue_timeout": OverloadedError,
    "generation": GenerationError,
    "unhealthy": UnhealthyError,
    "shutting_down": UnhealthyError,
    "unauthorized": AuthenticationError,
    "not_found": NotFoundError,
}
_BY_STATUS = {400: ValidationError, 401: AuthenticationError, 404: NotFoundError, 413: ValidationError, 422: ValidationError,
              424: GenerationError, 429: OverloadedError, 503: UnhealthyError}


def from_body(body: object, status: int | None) -> PagemillError:
    """The exception for an error body in either shape (or anything else)."""
    param = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        message, error_type = body["error"], body.get("error_type")
    elif isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        message, error_type, param = str(err.get("message")), err.get("code"), err.get("param")
    else:
        message, error_type = str(body), None
    cls = _BY_TYPE.get(error_type or "") or _BY_STATUS.get(status or 0, PagemillError)
    return cls(message, error_type=error_type, status=status, param=param)
