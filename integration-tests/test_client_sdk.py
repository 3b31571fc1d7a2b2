"""The `pagemill-client` SDK (clients/python) against the real server."""

import asyncio
import json

import httpx
import pytest

import pagemill_client
from pagemill_client import AsyncClient, Client

PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    with Client(server.url) as c:
        yield c


def test_generate_and_stream(client, server):
    raw = httpx.post(f"{server.url}/generate", timeout=60,
                     json={"inputs": PROMPT, "parameters": {"max_new_tokens": 8, "details": True}}).json()
    out = client.generate(PROMPT, max_new_tokens=8, details=True)
    assert isinstance(out, pagemill_client.GenerateResponse)
    assert out.generated_text == raw["generated_text"]
    assert [t.id for t in out.details.tokens] == [t["id"] for t in raw["details"]["tokens"]]
    events = list(client.generate_stream(PROMPT, max_new_tokens=8))
    assert all(isinstance(e, pagemill_client.StreamResponse) for e in events)
    assert events[-1].generated_text == raw["generated_text"]


def test_chat_and_completions(client):
    chat = client.chat(CHAT, temperature=0, max_tokens=8)
    assert isinstance(chat, pagemill_client.ChatCompletion)
    chunks = list(client.chat_stream(CHAT, temperature=0, max_tokens=8))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    comp = client.completions(PROMPT, temperature=0, max_tokens=5)
    assert isinstance(comp, pagemill_client.Completion) and comp.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions_stream(PROMPT, temperature=0, max_tokens=5))
    assert streamed == comp.choices[0].text


def test_typed_errors(client, server):
    with pytest.raises(pagemill_client.ValidationError) as e:
        client.generate(PROMPT, max_new_tokens=0)
    assert e.value.status == 422 and e.value.error_type == "validation"
    with pytest.raises(pagemill_client.ValidationError):
        client.chat([], max_tokens=2)
    with pytest.raises(pagemill_client.ValidationError):
        list(client.generate_stream(PROMPT, top_p=5))
    with pytest.raises(pagemill_client.NotFoundError):
        Client(server.url + "/nope").generate(PROMPT)


def test_async_client(server):
    async def main():
        async with AsyncClient(server.url) as c:
            out, chat = await asyncio.gather(c.generate(PROMPT, max_new_tokens=4),
                                             c.chat(CHAT, temperature=0, max_tokens=4))
            events = [e async for e in c.generate_stream(PROMPT, max_new_tokens=4)]
            with pytest.raises(pagemill_client.ValidationError):
                await c.completions(PROMPT, max_tokens=-1)
            return out, chat, events

    out, chat, events = asyncio.run(main())
    assert events[-1].generated_text == out.generated_text
    assert chat.choices[0].message.content


ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}


def test_chat_with_tools_streamed_and_joined(client):
    args = dict(tools=[ADD], tool_choice={"type": "function", "function": {"name": "add"}},
                parallel_tool_calls=False, temperature=0, max_tokens=48)
    ask = [{"role": "user", "content": "What is 2 + 3?"}]
    plain = client.chat(ask, **args)
    calls = plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "tool_calls" and calls[0].id.startswith("call_")
    assert calls[0].function.name == "add" and set(json.loads(calls[0].function.arguments)) == {"a", "b"}
    joiner = pagemill_client.ChatStreamJoiner()
    for chunk in client.chat_stream(ask, **args):
        joiner.add(chunk)
    joined = joiner.message()
    assert joiner.finish_reason() == "tool_calls" and joined.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in joined.tool_calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_token_id_prompts(client):
    ids = [t["id"] for t in client.tokenize(PROMPT)]
    by_text = client.completions(PROMPT, temperature=0, max_tokens=4)
    by_ids = client.completions([ids, ids], temperature=0, max_tokens=4)
    assert [c.text for c in by_ids.choices] == [by_text.choices[0].text] * 2
    streamed = pagemill_client.join_chat_stream(client.chat_stream(CHAT, temperature=0, max_tokens=6))
    assert streamed.content == client.chat(CHAT, temperature=0, max_tokens=6).choices[0].message.content
