"""Shared-token authentication of the router's calls: every RPC must carry
`authorization: Bearer <token>`, compared in constant time; anything else is
refused with UNAUTHENTICATED before the call reaches the service. Used when a
shard listens on TCP (`--listen`), where anyone on the network could reach it."""

from __future__ import annotations

import hmac

import grpc


def read_token(path: str) -> bytes:
    """The token: the file's first line, stripped; an empty one is an error."""
    with open(path, encoding="utf-8") as f:
        token = f.readline().strip()
    if not token:
        raise ValueError(f"{path} holds no token")
    return token.encode()


async def _refuse(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong shard auth token")


_REFUSE = grpc.unary_unary_rpc_method_handler(_refuse)


class TokenAuth(grpc.aio.ServerInterceptor):
    def __init__(self, token: bytes):
        self._expected = b"Bearer " + token

    async def intercept_service(self, continuation, details):
        given = b""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
        if hmac.compare_digest(given, self._expected):
            return await continuation(details)
        return _REFUSE
