"""Generated protobuf messages for proto/generate.proto.

`generate_pb2.py` is produced at build time (gitignored). For development:
    python -m grpc_tools.protoc -Iproto --python_out=server/pagemill/proto \
        --pyi_out=server/pagemill/proto proto/generate.proto
Only protoc's plain python output is used; the gRPC service is registered by
hand in pagemill.shard.service, so no generate_pb2_grpc.py is needed.
"""

try:
    from pagemill.proto import generate_pb2 as pb
except ImportError as e:  # pragma: no cover - depends on the build step
    raise ImportError(
        "pagemill.proto.generate_pb2 is missing: generate it with "
        "`python -m grpc_tools.protoc -Iproto --python_out=server/pagemill/proto "
        "--pyi_out=server/pagemill/proto proto/generate.proto` from the repository root"
    ) from e

SERVICE_NAME = "pagemill.v1.TextGenerationService"

__all__ = ["pb", "SERVICE_NAME"]
