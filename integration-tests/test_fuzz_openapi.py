"""Fuzzes every operation of /openapi.json with schemathesis (valid and
invalid bodies generated from the spec) against a live tiny-model server:
no 5xx, ever; documented status codes; and the server still answers a valid
request after each operation's examples."""

import os

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

from reliability import check, request, wait_idle
from server import launch

EXAMPLES = int(os.environ.get("PAGEMILL_FUZZ_EXAMPLES", "100"))


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    # Small token limits keep every generated request short.
    s = launch(str(tiny_model_dir), "--kv-cache-memory", "64MiB", "--max-input-tokens", "64",
               "--max-total-tokens", "128", "--payload-limit", "512KB")
    yield s
    s.stop()


def _operations(url: str):
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    for result in schema.get_all_operations():
        yield result.ok()


# schemathesis' own pytest plugin does not load under pytest 9, so each
# operation runs as a plain hypothesis test over its strategy.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_fuzzed_requests_never_get_a_5xx(fuzz_server, mode):
    counts: dict[str, int] = {}
    session = requests.Session()

    for op in _operations(fuzz_server.url):
        label = f"{op.method.upper()} {op.path}"
        if mode is GenerationMode.NEGATIVE and op.method.upper() == "GET":
            continue  # no parameters, so nothing to make invalid

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                  derandomize=True, database=None)
        def fuzz(case):
            counts[label] = counts.get(label, 0) + 1
            case.call_and_validate(base_url=fuzz_server.url, session=session, timeout=60,
                                   checks=[not_a_server_error, status_code_conformance, content_type_conformance])

        fuzz()
        # Meanwhile the server keeps serving valid requests.
        path, body = request("generate", 0, 3)
        r = httpx.post(fuzz_server.url + path, json=body, timeout=60)
        check("generate", 3, r.status_code, r.content)
    print(f"\nfuzz ({mode.value}): {sum(counts.values())} requests over {len(counts)} operations: {counts}")
    assert len(counts) >= (10 if mode is GenerationMode.POSITIVE else 6)


def test_still_serving_after_the_fuzz(fuzz_server):
    path, body = request("generate_stream", 0, 8)
    r = httpx.post(fuzz_server.url + path, json=body, timeout=60)
    check("generate_stream", 8, r.status_code, r.content)
    wait_idle(fuzz_server)
    assert "panicked" not in fuzz_server.logs()
