"""`Client` (sync) and `AsyncClient` over httpx: TGI routes (`generate`,
`generate_stream`) and OpenAI routes (`chat`, `completions`, and their
streams). Every error response raises a typed `PagemillError` subclass."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from pagemill_client.errors import from_body
from pagemill_client.types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    GenerateResponse,
    StreamResponse,
)

T = TypeVar("T", bound=BaseModel)
#: A `/v1/completions` prompt: text, texts, token ids, or lists of token ids.
Prompt = str | list[str] | list[int] | list[list[int]]


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body: object = response.json()
    except ValueError:
        body = response.text
    raise from_body(body, response.status_code)


def _sse_payload(line: str) -> dict | None:
    """The JSON of one `data:` line; None for other lines and `[DONE]`.
    An error event raises."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    payload = json.loads(data)
    if isinstance(payload, dict) and isinstance(payload.get("error"), (str, dict)):
        raise from_body(payload, None)
    return payload


def _generate_body(prompt: str, parameters: dict[str, Any]) -> dict:
    return {"inputs": prompt, "parameters": {k: v for k, v in parameters.items() if v is not None}}


def _openai_body(base: dict, options: dict[str, Any], stream: bool) -> dict:
    body = dict(base, **{k: v for k, v in options.items() if v is not None})
    body["stream"] = stream
    return body


class Client:
    """Synchronous client.

    >>> client = Client("http://127.0.0.1:3000")
    >>> client.generate("The capital of France is", max_new_tokens=10).generated_text
    """

    def __init__(self, base_url: str = "http://127.0.0.1:3000", api_key: str | None = None,
                 timeout: float = 120.0, http: httpx.Client | None = None):
        self.base_url = base_url.rstrip("/")
        self._http = http or httpx.Client(timeout=timeout)
        self._headers = _headers(api_key)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, path: str, body: dict, model: type[T]) -> T:
        r = self._http.post(self.base_url + path, json=body, headers=self._headers)
        _raise_for(r)
        return model.model_validate(r.json())

    def _stream(self, path: str, body: dict, model: type[T]) -> Iterator[T]:
        with self._http.stream("POST", self.base_url + path, json=body, headers=self._headers) as r:
            if r.status_code >= 400:
                r.read()
                _raise_for(r)
            for line in r.iter_lines():
                payload = _sse_payload(line)
                if payload is not None:
                    yield model.model_validate(payload)

    def health(self) -> bool:
        return self._http.get(self.base_url + "/health").status_code == 200

    def info(self) -> dict:
        r = self._http.get(self.base_url + "/info")
        _raise_for(r)
        return r.json()

    def tokenize(self, prompt: str) -> list[dict]:
        r = self._http.post(self.base_url + "/tokenize", json={"inputs": prompt}, headers=self._headers)
        _raise_for(r)
        return r.json()

    def generate(self, prompt: str, **parameters: Any) -> GenerateResponse:
        """TGI `/generate`; keyword arguments are TGI parameters (`max_new_tokens`, `details`, ...)."""
        return self._post("/generate", _generate_body(prompt, parameters), GenerateResponse)

    def generate_stream(self, prompt: str, **parameters: Any) -> Iterator[StreamResponse]:
        return self._stream("/generate_stream", _generate_body(prompt, parameters), StreamResponse)

    def chat(self, messages: list[dict], **options: Any) -> ChatCompletion:
        """OpenAI `/v1/chat/completions`; options are OpenAI fields (`max_tokens`, `temperature`,
        `tools`, `tool_choice`, ...). Tool calls are in `choices[i].message.tool_calls`."""
        return self._post("/v1/chat/completions", _openai_body({"messages": messages}, options, False), ChatCompletion)

    def chat_stream(self, messages: list[dict], **options: Any) -> Iterator[ChatCompletionChunk]:
        return self._stream("/v1/chat/completions", _openai_body({"messages": messages}, options, True),
                            ChatCompletionChunk)

    def completions(self, prompt: Prompt, **options: Any) -> Completion:
        """OpenAI `/v1/completions`; `prompt` may be text, texts, token ids or lists of token ids."""
        return self._post("/v1/completions", _openai_body({"prompt": prompt}, options, False), Completion)

    def completions_stream(self, prompt: Prompt, **options: Any) -> Iterator[Completion]:
        return self._stream("/v1/completions", _openai_body({"prompt": prompt}, options, True), Completion)


class AsyncClient:
    """Asynchronous client, same methods as `Client` (awaitable / async iterators)."""

    def __init__(self, base_url: str = "http://127.0.0.1:3000", api_key: str | None = None,
                 timeout: float = 120.0, http: httpx.AsyncClient | None = None):
        self.base_url = base_url.rstrip("/")
        self._http = http or httpx.AsyncClient(timeout=timeout)
        self._headers = _headers(api_key)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _post(self, path: str, body: dict, model: type[T]) -> T:
        r = await self._http.post(self.base_url + path, json=body, headers=self._headers)
        _raise_for(r)
        return model.model_validate(r.json())

    async def _stream(self, path: str, body: dict, model: type[T]) -> AsyncIterator[T]:
        async with self._http.stream("POST", self.base_url + path, json=body, headers=self._headers) as r:
            if r.status_code >= 400:
                await r.aread()
                _raise_for(r)
            async for line in r.aiter_lines():
                payload = _sse_payload(line)
                if payload is not None:
                    yield model.model_validate(payload)

    async def health(self) -> bool:
        return (await self._http.get(self.base_url + "/health")).status_code == 200

    async def info(self) -> dict:
        r = await self._http.get(self.base_url + "/info")
        _raise_for(r)
        return r.json()

    async def generate(self, prompt: str, **parameters: Any) -> GenerateResponse:
        return await self._post("/generate", _generate_body(prompt, parameters), GenerateResponse)

    def generate_stream(self, prompt: str, **parameters: Any) -> AsyncIterator[StreamResponse]:
        return self._stream("/generate_stream", _generate_body(prompt, parameters), StreamResponse)

    async def chat(self, messages: list[dict], **options: Any) -> ChatCompletion:
        return await self._post("/v1/chat/completions", _openai_body({"messages": messages}, options, False),
                                ChatCompletion)

    def chat_stream(self, messages: list[dict], **options: Any) -> AsyncIterator[ChatCompletionChunk]:
        return self._stream("/v1/chat/completions", _openai_body({"messages": messages}, options, True),
                            ChatCompletionChunk)

    async def completions(self, prompt: Prompt, **options: Any) -> Completion:
        return await self._post("/v1/completions", _openai_body({"prompt": prompt}, options, False), Completion)

    def completions_stream(self, prompt: Prompt, **options: Any) -> AsyncIterator[Completion]:
        return self._stream("/v1/completions", _openai_body({"prompt": prompt}, options, True), Completion)
