"""pagemill-client's error mapping and SSE parsing, without a server."""

import sys
from pathlib import Path

import pytest

# The SDK of this tree (scripts/test.sh also pip-installs it).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "clients" / "python"))

import pagemill_client as pc  # noqa: E402
from pagemill_client.client import _sse_payload  # noqa: E402
from pagemill_client.errors import from_body  # noqa: E402


@pytest.mark.parametrize("error_type,status,cls", [
    ("validation", 422, pc.ValidationError),
    ("invalid_json", 422, pc.ValidationError),
    ("overloaded", 429, pc.OverloadedError),
    ("generation", 424, pc.GenerationError),
    ("unhealthy", 503, pc.UnhealthyError),
    ("unauthorized", 401, pc.AuthenticationError),
    ("not_found", 404, pc.NotFoundError),
    ("queue_timeout", 429, pc.OverloadedError),
    ("shutting_down", 503, pc.UnhealthyError),
    # In a stream the error event has no status: the type alone decides.
    ("queue_timeout", None, pc.OverloadedError),
])
def test_error_type_picks_the_class(error_type, status, cls):
    e = from_body({"error": "boom", "error_type": error_type}, status)
    assert type(e) is cls and e.message == "boom" and e.status == status and e.error_type == error_type


def test_openai_shape_is_read_too():
    e = from_body({"error": {"message": "`top_p` bad", "type": "invalid_request_error", "param": "top_p",
                             "code": "validation"}}, 400)
    assert type(e) is pc.ValidationError and e.param == "top_p" and e.error_type == "validation"
    assert e.message == "`top_p` bad" and e.status == 400
    with pytest.raises(pc.GenerationError):
        _sse_payload('data: {"error": {"message": "shard died", "type": "server_error", "param": null, '
                     '"code": "generation"}}')


def test_status_is_the_fallback():
    assert isinstance(from_body("gateway said no", 429), pc.OverloadedError)
    assert isinstance(from_body({"detail": "x"}, 401), pc.AuthenticationError)
    assert type(from_body("?", 418)) is pc.PagemillError


def test_sse_lines():
    assert _sse_payload("data: [DONE]") is None
    assert _sse_payload(": keep-alive") is None
    assert _sse_payload('data: {"index": 1}') == {"index": 1}
    with pytest.raises(pc.GenerationError):
        _sse_payload('data: {"error": "shard died", "error_type": "generation"}')
