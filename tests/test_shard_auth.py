"""The shard's token check (shard/auth.py) on a real gRPC server: a call
without the token, or with another one, is refused with UNAUTHENTICATED
before it reaches the service; the right token passes."""

import asyncio

import grpc
import pytest

from pagemill.shard.auth import TokenAuth, read_token


def test_read_token(tmp_path):
    f = tmp_path / "t"
    f.write_text("  abc123 \nsecond line\n")
    assert read_token(str(f)) == b"abc123"
    f.write_text("\n")
    with pytest.raises(ValueError, match="no token"):
        read_token(str(f))


def test_calls_need_the_token(tmp_path):
    sock = f"unix://{tmp_path}/s.sock"
    reached = []

    async def echo(request, context):
        reached.append(request)
        return request

    async def main():
        server = grpc.aio.server(interceptors=[TokenAuth(b"s3cret")])
        handler = grpc.method_handlers_generic_handler("t.T", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(sock)
        await server.start()
        codes = []
        async with grpc.aio.insecure_channel(sock) as ch:
            call = ch.unary_unary("/t.T/Echo")
            for md in (None, [("authorization", "Bearer wrong")], [("authorization", "s3cret")],
                       [("authorization", "Bearer s3cret")]):
                try:
                    assert await call(b"hi", metadata=md, timeout=10) == b"hi"
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
        await server.stop(None)
        return codes

    codes = asyncio.run(main())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 3 + [grpc.StatusCode.OK]
    assert reached == [b"hi"], "a refused call reached the service"
