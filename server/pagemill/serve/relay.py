"""A request relayed to this replica's own pagemill server, and its answer back,
streams included. When the server goes away mid-stream the stream ends with one
error event in OpenAI's shape (what the `openai` client raises on), never a hang
or a silent close; a request it cannot take is a 503 in the same shape."""

from __future__ import annotations

import json

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

# Hop-by-hop headers (and those the relay recomputes) are not passed on.
HOP = {"host", "connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade"}


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": "unhealthy"}}


def unavailable(message: str) -> Response:
    return JSONResponse(_error(message), status_code=503)


def _error_event(message: str) -> bytes:
    return f"data: {json.dumps(_error(message))}\n\n".encode()


def _headers(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP}


async def relay(http: httpx.AsyncClient, request: Request, extra_headers: dict[str, str]) -> Response:
    """`request` sent on to the server behind `http`; its answer, streamed when it is an event stream."""
    upstream_request = http.build_request(request.method, request.url.path, params=request.query_params,
                                          headers=_headers(request.headers), content=await request.body())
    try:
        upstream = await http.send(upstream_request, stream=True)
    except httpx.HTTPError as e:
        return unavailable(f"this replica's pagemill server is not answering: {e!r}")
    headers = {**_headers(upstream.headers), **extra_headers}
    if upstream.headers.get("content-type", "").startswith("text/event-stream"):
        return StreamingResponse(_events(upstream), status_code=upstream.status_code, headers=headers)
    try:
        content = await upstream.aread()
    except httpx.HTTPError as e:
        return unavailable(f"this replica's pagemill server went away: {e!r}")
    finally:
        await upstream.aclose()
    return Response(content, status_code=upstream.status_code, headers=headers)


async def _events(upstream: httpx.Response):
    """Whole SSE events as they come; an error event if the server goes away mid-stream."""
    pending = b""
    try:
        async for chunk in upstream.aiter_raw():
            pending += chunk
            end = pending.rfind(b"\n\n")
            if end >= 0:
                yield pending[: end + 2]
                pending = pending[end + 2:]
    except httpx.HTTPError as e:
        yield _error_event(f"this replica's pagemill server went away mid-stream: {e!r}")
    finally:
        await upstream.aclose()
