"""The scheduler never hangs and orders by priority, on a real server with a
small pool (tiny random-weight model: the figures are about scheduling).

- A request that can never fit the pool gets its 4xx at once, in each API's
  error shape, while other requests keep streaming.
- Under a priority mix, better-priority requests overtake queued worse ones.
- Aging bounds starvation: under a steady stream of better-priority
  newcomers, only those arriving within (priority gap) x `--priority-aging-ms`
  after a request can overtake it.
"""

import concurrent.futures as cf
import threading
import time

import httpx
import pytest

from server import launch

BLOCKS = 100  # of 16 tokens: 99 usable (block 0 is scratch), 1584 tokens
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head dim x float32
AGING_MS = 1000


@pytest.fixture(scope="module")
def small(tiny_model_dir):
    s = launch(str(tiny_model_dir), "--block-size", "16", "--kv-cache-memory", str(BLOCKS * 16 * BYTES_PER_TOKEN),
               "--max-input-tokens", "512", "--max-total-tokens", "1024", "--max-batch-prefill-tokens", "1024",
               "--max-batch-size", "1", "--max-concurrent-requests", "64", "--priority-aging-ms", str(AGING_MS))
    yield s
    s.stop()


def generate(server, prompt, max_new_tokens, priority=None, timeout=300, client=httpx):
    params = {"max_new_tokens": max_new_tokens, "ignore_eos_token": True}
    if priority is not None:
        params["priority"] = priority
    return client.post(f"{server.url}/generate", timeout=timeout, json={"inputs": prompt, "parameters": params})


def test_pool_is_the_size_the_test_assumes(small):
    assert small.info()["kv_blocks_total"] == BLOCKS - 1


def test_a_request_that_can_never_fit_gets_its_4xx_at_once_while_others_stream(small):
    before = small.metric("pagemill_requests_too_large_total")
    with cf.ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(generate, small, f"Keep going {i}", 300) for i in range(3)]
        time.sleep(0.5)
        # 2 forks x (20-odd prompt + 999) tokens: about 128 blocks, the pool has 99.
        # Each fork alone (about 64 blocks) would fit, so only the pool check can refuse it.
        t0 = time.monotonic()
        tgi = httpx.post(f"{small.url}/generate", timeout=30, json={
            "inputs": "Tell me a very long story about the sea",
            "parameters": {"max_new_tokens": 1000, "best_of": 2, "do_sample": True}})
        tgi_s = time.monotonic() - t0
        t0 = time.monotonic()
        oai = httpx.post(f"{small.url}/v1/completions", timeout=30, json={
            "prompt": "Tell me a very long story about the sea", "max_tokens": 1000, "n": 2, "temperature": 1.0})
        oai_s = time.monotonic() - t0
        results = [f.result() for f in busy]
    assert tgi.status_code == 422, tgi.text
    assert tgi.json()["error_type"] == "validation"
    assert "can never fit the KV cache" in tgi.json()["error"] and "the pool holds 99" in tgi.json()["error"]
    assert oai.status_code == 400, oai.text
    err = oai.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "validation"
    assert "can never fit the KV cache" in err["message"]
    # "At once": not after the busy requests (300 tokens each, one at a time) finished.
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    print(f"refusal took {tgi_s * 1000:.0f} ms (TGI), {oai_s * 1000:.0f} ms (OpenAI)")
    assert max(tgi_s, oai_s) < 2.0
    assert small.metric("pagemill_requests_too_large_total") - before == 2
    # One fork of the same size fits and is served.
    r = generate(small, "Tell me a very long story about the sea", 600)
    assert r.status_code == 200, r.text


def test_better_priority_overtakes_queued_worse_priority(small):
    def one_try():
        done = []
        lock = threading.Lock()
        # One shared client: a fresh one per request spends tens of ms (TLS context, pool) in
        # each thread, so under load the "later" requests could reach the server late.
        client = httpx.Client(timeout=300)

        def run(name, prompt, n, priority, openai=False):
            if openai:
                r = client.post(f"{small.url}/v1/completions", json={
                    "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "priority": priority})
            else:
                r = generate(small, prompt, n, priority, client=client)
            assert r.status_code == 200, r.text
            with lock:
                done.append(name)

        def queued():
            for line in client.get(f"{small.url}/metrics").text.splitlines():
                if line.startswith("pagemill_queue_size "):
                    return float(line.split()[1])
            raise KeyError("pagemill_queue_size")

        with client, cf.ThreadPoolExecutor(16) as pool:
            # Eight worse-priority requests fill the queue (one seat: they run one at a time; the
            # first runs longest, so the others have time to arrive); once most of them wait
            # there, two better-priority ones arrive, on each API.
            t0 = time.monotonic()
            futures = [pool.submit(run, f"low{i}", f"Low {i}", 400 if i == 0 else 100, 5) for i in range(8)]
            while queued() < 6 and time.monotonic() - t0 < 60:
                time.sleep(0.005)
            with lock:
                ahead = len(done) + 1  # lows finished, and the one in the seat
            futures += [pool.submit(run, "high-tgi", "High one", 100, -5),
                        pool.submit(run, "high-openai", "High two", 100, -5, True)]
            for f in futures:
                f.result()
            elapsed = time.monotonic() - t0
        print(f"completion order ({elapsed:.1f} s, {ahead} lows finished or seated as the highs were sent):", done)
        return ahead, done

    # The check needs the lows queued when the highs are sent; on a loaded machine their requests
    # can reach the server more slowly than the seat serves them (seen once in CI: the queue never
    # held six). That is the setup missing, not priority failing: try again, at most 3 times.
    for _ in range(3):
        ahead, done = one_try()
        if ahead <= 3:
            break
    assert ahead <= 3, "the lows were not queued when the highs were sent in 3 tries: the test measured nothing"
    # At most these finish before each high: the lows finished or seated when it was sent, one
    # low seated between its sending and its arrival, and the other high.
    positions = [done.index("high-tgi"), done.index("high-openai")]
    assert max(positions) <= ahead + 2, done


def test_aging_bounds_how_long_a_worse_priority_waits(small):
    """Priority 10 against an endless stream of priority 0: newcomers that
    arrive 10 aging intervals or more after it rank behind it."""

    def one_try():
        stop = threading.Event()
        highs = []  # (submitted, finished)

        def stream():
            while not stop.is_set():
                t = time.monotonic()
                r = generate(small, "Stream of newcomers", 16, 0)
                assert r.status_code == 200
                highs.append((t, time.monotonic()))

        # Enough clients that better-priority requests are always queued.
        threads = [threading.Thread(target=stream) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        r = generate(small, "Patient request", 16, 10)
        t1 = time.monotonic()
        stop.set()
        for t in threads:
            t.join()
        assert r.status_code == 200
        overtook = [(a, b) for a, b in highs if a > t0 and b < t1]
        print(f"priority 10 finished after {t1 - t0:.2f} s; {len(overtook)} priority-0 newcomers overtook it, "
              f"submitted at most {max((a - t0 for a, _ in overtook), default=0):.2f} s after it")
        return t0, overtook

    # The check needs the stream to hold the seat when the patient request arrives; on a loaded
    # machine all six clients can be between requests at that moment (seen once in CI: it went
    # straight in, 0.26 s). That is the setup missing, not aging failing: try again, at most 3 times.
    for _ in range(3):
        t0, overtook = one_try()
        if overtook:
            break
    # It did wait behind newcomers (priority works), but none submitted 10 intervals after it
    # (plus 0.25 s for the request to reach the queue) got ahead.
    assert overtook, "no newcomer overtook in 3 tries: the stream did not keep the seat busy"
    late = [a - t0 for a, b in overtook if a - t0 > 10 * AGING_MS / 1000 + 0.25]
    assert not late, late
