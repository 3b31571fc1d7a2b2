"""The `pagemill-client` SDK (clients/python) against the real server."""

import asyncio

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
