"""Client for the pagemill text-generation server."""

from pagemill_client.client import AsyncClient, Client
from pagemill_client.errors import (
    AuthenticationError,
    GenerationError,
    NotFoundError,
    OverloadedError,
    PagemillError,
    UnhealthyError,
    ValidationError,
)
from pagemill_client.types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    Details,
    GenerateResponse,
    StreamResponse,
    Token,
)

__all__ = [
    "AsyncClient", "Client", "AuthenticationError", "GenerationError", "NotFoundError", "OverloadedError",
    "PagemillError", "UnhealthyError", "ValidationError", "ChatCompletion", "ChatCompletionChunk", "Completion",
    "Details", "GenerateResponse", "StreamResponse", "Token",
]
__version__ = "0.1.0"
