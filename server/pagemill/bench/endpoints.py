"""Streaming request adapters: TGI `/generate_stream` and OpenAI `/v1/completions`.

Both speak SSE; an adapter builds the request body and turns each `data:`
line into the number of tokens it carries (TGI sends one event per token;
an OpenAI chunk may carry several, its final usage chunk gives the count).
Switching endpoints is `--endpoint tgi|openai`; nothing else changes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from pagemill.bench.datasets import SampleRequest
from pagemill.bench.metrics import RequestRecord


@dataclass
class Endpoint:
    name: str
    path: str

    def body(self, req: SampleRequest, model: str) -> dict:
        raise NotImplementedError

    def tokens_in(self, event: dict) -> int:
        """Output tokens carried by one parsed event; raises on an error event."""
        raise NotImplementedError

    def final_count(self, event: dict) -> int | None:
        """The server's own output-token count, when the event reports it."""
        return None


class TgiEndpoint(Endpoint):
    def body(self, req: SampleRequest, model: str) -> dict:
        return {
            "inputs": req.prompt,
            "parameters": {"max_new_tokens": req.output_len, "ignore_eos_token": True, "details": True},
        }

    def tokens_in(self, event: dict) -> int:
        if "error" in event:
            raise RuntimeError(f"{event.get('error_type', 'error')}: {event['error']}")
        return 1 if event.get("token") is not None else 0

    def final_count(self, event: dict) -> int | None:
        details = event.get("details") or {}
        return details.get("generated_tokens")


class OpenAIEndpoint(Endpoint):
    def body(self, req: SampleRequest, model: str) -> dict:
        return {
            "model": model, "prompt": req.prompt, "max_tokens": req.output_len, "stream": True,
            "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True},
        }  # fmt: skip

    def tokens_in(self, event: dict) -> int:
        if "error" in event:
            err = event["error"]
            raise RuntimeError(err if isinstance(err, str) else json.dumps(err))
        choices = event.get("choices") or []
        return 1 if any(c.get("text") for c in choices) else 0

    def final_count(self, event: dict) -> int | None:
        usage = event.get("usage") or {}
        return usage.get("completion_tokens")


ENDPOINTS = {"tgi": TgiEndpoint("tgi", "/generate_stream"), "openai": OpenAIEndpoint("openai", "/v1/completions")}


async def send(client: httpx.AsyncClient, base_url: str, ep: Endpoint, req: SampleRequest,
               model: str = "") -> RequestRecord:  # fmt: skip
    """One streamed request; every token's arrival time is recorded."""
    rec = RequestRecord(prompt_len=req.prompt_len, start=time.perf_counter())
    counted, reported = 0, None
    try:
        async with client.stream("POST", base_url + ep.path, json=ep.body(req, model)) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                n = ep.tokens_in(event)
                if n:
                    now = time.perf_counter()
                    rec.token_times.extend([now] * n)
                    counted += n
                reported = ep.final_count(event) or reported
        rec.output_len = reported or counted
        rec.success = counted > 0
        if not rec.success:
            rec.error = "stream ended without tokens"
    except Exception as e:  # a failed request is a data point, not a crash
        rec.error = f"{type(e).__name__}: {e}"
    return rec
