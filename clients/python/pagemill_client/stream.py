"""Joining a streamed chat reply back into messages, as the deltas of
`chat_stream` arrive: content, reasoning and tool calls whose arguments
come in fragments."""

from __future__ import annotations

from collections.abc import Iterable

from pagemill_client.types import ChatCompletionChunk, ChatMessage, FunctionCall, ToolCall


class ChatStreamJoiner:
    """Feed chunks with `add`; `message(i)` is choice i's reply so far and
    `finish_reason(i)` its finish reason once sent."""

    def __init__(self) -> None:
        self._content: dict[int, list[str]] = {}
        self._reasoning: dict[int, list[str]] = {}
        self._calls: dict[int, dict[int, dict]] = {}
        self._finish: dict[int, str] = {}

    def add(self, chunk: ChatCompletionChunk) -> None:
        for c in chunk.choices:
            if c.delta.content:
                self._content.setdefault(c.index, []).append(c.delta.content)
            if c.delta.reasoning_content:
                self._reasoning.setdefault(c.index, []).append(c.delta.reasoning_content)
            for d in c.delta.tool_calls or []:
                call = self._calls.setdefault(c.index, {}).setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments
            if c.finish_reason:
                self._finish[c.index] = c.finish_reason

    def message(self, index: int = 0) -> ChatMessage:
        calls = [ToolCall(id=c["id"], function=FunctionCall(name=c["name"], arguments=c["arguments"]))
                 for _, c in sorted(self._calls.get(index, {}).items())]
        content = "".join(self._content.get(index, []))
        reasoning = "".join(self._reasoning.get(index, [])) or None
        return ChatMessage(role="assistant", content=content if content or not calls else None,
                           reasoning_content=reasoning, tool_calls=calls or None)

    def finish_reason(self, index: int = 0) -> str | None:
        return self._finish.get(index)


def join_chat_stream(chunks: Iterable[ChatCompletionChunk], index: int = 0) -> ChatMessage:
    """The whole reply of choice `index` from a `chat_stream`."""
    joiner = ChatStreamJoiner()
    for chunk in chunks:
        joiner.add(chunk)
    return joiner.message(index)
