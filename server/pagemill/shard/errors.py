"""Errors the shard reports to the router as a gRPC status, not a crash."""

from __future__ import annotations

import grpc


class ShardError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> ShardError:
    return ShardError(grpc.StatusCode.INVALID_ARGUMENT, message)
