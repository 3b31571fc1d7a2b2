"""Typed responses (pydantic v2). Extra fields the server may add later are kept, not rejected."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


FinishReason = Literal["length", "eos_token", "stop_sequence"]


class Token(_Model):
    id: int
    text: str
    logprob: float | None = None
    special: bool = False


class PrefillToken(_Model):
    id: int
    text: str
    logprob: float | None = None


class BestOfSequence(_Model):
    generated_text: str
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    prefill: list[PrefillToken] = []
    tokens: list[Token] = []
    top_tokens: list[list[Token]] | None = None


class Details(_Model):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    prefill: list[PrefillToken] = []
    tokens: list[Token] = []
    top_tokens: list[list[Token]] | None = None
    best_of_sequences: list[BestOfSequence] | None = None


class GenerateResponse(_Model):
    generated_text: str
    details: Details | None = None


class StreamDetails(_Model):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    input_length: int | None = None


class StreamResponse(_Model):
    index: int
    token: Token
    top_tokens: list[Token] | None = None
    generated_text: str | None = None
    details: StreamDetails | None = None


class Usage(_Model):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class FunctionCall(_Model):
    name: str
    #: The arguments as JSON text (`json.loads` it).
    arguments: str


class ToolCall(_Model):
    id: str
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: str
    content: str | None = None
    #: The think block's text, with a server started with `--reasoning-parser`.
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(_Model):
    content: list[ChatLogprob] = []


class ChatChoice(_Model):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(_Model):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class FunctionCallDelta(_Model):
    name: str | None = None
    arguments: str = ""


class ToolCallDelta(_Model):
    """A streamed tool call: the first delta of a call has `id` and
    `function.name`; the next ones fragments of `function.arguments`."""
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta


class ChatDelta(_Model):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Model):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Model):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Model):
    tokens: list[str] = []
    # With echo: the prompt's tokens first, the first one's entries None.
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(_Model):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(_Model):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
