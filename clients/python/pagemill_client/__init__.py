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
from pagemill_client.stream import ChatStreamJoiner, join_chat_stream
from pagemill_client.types import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatMessage,
    Completion,
    Details,
    GenerateResponse,
    StreamResponse,
    Token,
    ToolCall,
)

__all__ = [
    "AsyncClient", "Client", "AuthenticationError", "GenerationError", "NotFoundError", "OverloadedError",
    "PagemillError", "UnhealthyError", "ValidationError", "ChatCompletion", "ChatCompletionChunk", "Completion",
    "Details", "GenerateResponse", "StreamResponse", "Token", "ChatMessage", "ToolCall", "ChatStreamJoiner",
    "join_chat_stream",
]
__version__ = "0.1.0"
