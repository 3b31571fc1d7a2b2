"""`pagemill bench compare`: pagemill beside vLLM-CPU and llama.cpp's server.

Each configuration runs alone, fresh, `--runs` times (interleaved: run 1 of
every server, then run 2...), so a warm prefix cache or a noisy minute
does not favour one server:

  wait for an idle machine (busy CPUs over 2 s) -> its read bandwidth (the
  batch-1 memory floor at the server's precision) -> launch -> wait for
  /health -> warm up -> resident memory of the whole process tree ->
  the c=64 workload -> the batch-1 workload -> stop the whole tree.

Every server gets the same seeded requests through the same load generator
(bench/load.py) over its OpenAI `/v1/completions` streaming endpoint with
`ignore_eos`, one fresh connection per request (llama.cpp closes each one
after a streamed response, so all servers are driven alike). Every request's
output is checked against the tokens it asked for; a server that stops
early is flagged in the table, not dropped. Figures are medians over runs.
`--out` is the benchmark's folder: the latest run's files replace the last
ones there, and each run appends a row to its history.jsonl (bench/history.py).
Install the peers first: benchmarks/peers/install.sh.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict

import httpx

from pagemill.bench import compare_report as rep
from pagemill.bench import cpu_idle
from pagemill.bench import history
from pagemill.bench.datasets import uniform_dataset
from pagemill.bench.load import LoadConfig, run_load, warm
from pagemill.bench import server_probe as probe
from pagemill.bench.metrics import compute_metrics
from pagemill.bench.model_presets import resolve_args
from pagemill.bench.peer_configs import ServerConfig, find_llama_server, select
from pagemill.bench.compare_floors import batch1_floor_ms, workload_ceiling
from pagemill.bench.roofline import measure_machine
from pagemill.models.config import ModelConfig


def _log(msg: str) -> None:
    print(f"[compare] {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def cpu_info() -> dict:
    try:
        with open("/proc/cpuinfo") as f:
            return rep.parse_cpuinfo(f.read())
    except OSError:
        return rep.parse_cpuinfo("")


def placeholders(peers: str, model_dir: str, port: int) -> dict[str, str]:
    """Values for the launch commands' {placeholders} (see peer_configs)."""
    n = os.cpu_count() or 1
    # vLLM's CPU guide asks for tcmalloc and Intel's OpenMP preloaded.
    preload = [p for pat in ("/usr/lib/*/libtcmalloc_minimal.so.4", os.path.join(peers, "vllm", "lib", "libiomp5.so"),
                             os.path.join(peers, "vllm", "lib", "python*", "site-packages", "**", "libiomp5.so"))
               for p in sorted(glob.glob(pat, recursive=True))[:1]]  # fmt: skip
    return {"port": str(port), "model_dir": model_dir, "peers": peers, "python": sys.executable,
            "threads": str(n), "last_cpu": str(n - 1), "llama_server": find_llama_server(peers),
            "vllm_preload": ":".join(preload[:2])}  # fmt: skip


class PeerServer:
    """One server in its own session, stopped as a whole process tree."""

    def __init__(self, config: ServerConfig, values: dict[str, str], log_path: str, timeout_s: float) -> None:
        self.config, self.values, self.log_path, self.timeout_s = config, values, log_path, timeout_s
        self.base_url = f"http://127.0.0.1:{values['port']}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "PeerServer":
        argv = self.config.argv(self.values)
        env = {**os.environ, **self.config.environment(self.values)}
        self.log = open(self.log_path, "w")
        self.log.write("$ " + " ".join(argv) + "\n")
        self.log.flush()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return self._wait_ready()
        except BaseException:  # a `with` never exits what failed to enter: stop it here
            self.__exit__()
            raise

    def _wait_ready(self) -> "PeerServer":
        while time.monotonic() - self.started < self.timeout_s:
            rc = self.proc.poll()
            if rc is not None:
                raise RuntimeError(f"{self.config.name} exited with {rc}; see {self.log_path}")
            try:
                if httpx.get(self.base_url + self.config.ready_path, timeout=2).status_code == 200:
                    self.ready_s = time.monotonic() - self.started
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.config.name} not ready after {self.timeout_s:.0f}s; see {self.log_path}")

    def tree(self):
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def rss_mib(self) -> float:
        import psutil

        total = 0
        for p in self.tree():
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total / 2**20

    def __exit__(self, *exc) -> None:
        import psutil

        if self.proc is None:
            return
        procs = self.tree()  # children may leave the process group; remember them all
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        _, alive = psutil.wait_procs(procs, timeout=30)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)
        self.proc.wait()
        self.proc = None
        self.log.close()


def measure(records, requests, duration: float) -> tuple[dict, rep.TokenCheck]:
    metrics = compute_metrics(records, duration, None, (50.0, 99.0)).to_dict()
    check = rep.check_tokens([r.output_len for r in requests],
                             [rec.output_len if rec.success else None for rec in records])  # fmt: skip
    metrics["chunks_counted"] = sum(len(rec.token_times) for rec in records)
    return metrics, check


def one_run(config: ServerConfig, values: dict, a, main_reqs, b1_reqs, warm_reqs, log_path: str,
            model_cfg: ModelConfig) -> dict:
    cfg = LoadConfig(base_url=f"http://127.0.0.1:{values['port']}", endpoint="openai", model=a.served_model_name,
                     max_concurrency=a.concurrency, seed=a.seed, progress=not a.no_progress, keepalive=False)  # fmt: skip
    idle = cpu_idle.wait_idle(a.idle_load, a.idle_wait_s)
    if not idle["idle"]:
        busy = "?" if idle["busy_cpus"] is None else f"{idle['busy_cpus']:.2f}"
        _log(f"warning: still busy after {a.idle_wait_s:.0f}s ({busy} CPUs busy, load average "
             f"{idle['load_avg']:.2f}); measuring anyway")
    out: dict = {"load_before": idle["load_avg"], "busy_cpus_before": idle["busy_cpus"]}
    # The machine's read bandwidth now, idle, with no server loaded: the batch-1
    # memory floor of this run (docs/benchmarks.md).
    machine = measure_machine()
    out["machine"] = asdict(machine)
    with PeerServer(config, values, log_path, a.ready_timeout_s) as server:
        out["ready_s"] = server.ready_s
        asyncio.run(warm(cfg, warm_reqs[0], n=2))
        asyncio.run(run_load(warm_reqs, cfg, desc="warm-up"))  # warms the batched paths too
        out["rss_mib"] = server.rss_mib()
        before = _counters(cfg.base_url)
        records, duration = asyncio.run(run_load(main_reqs, cfg, desc=f"{config.name} c={a.concurrency}"))
        main, check = measure(records, main_reqs, duration)
        out["steps"] = _step_accounting(before, _counters(cfg.base_url))
        out["rss_after_mib"] = server.rss_mib()
        b1cfg = LoadConfig(**{**cfg.__dict__, "max_concurrency": 1})
        records, duration = asyncio.run(run_load(b1_reqs, b1cfg, desc=f"{config.name} batch-1"))
        b1, b1check = measure(records, b1_reqs, duration)
    out.update(main=main, batch1=b1, tokens=check.to_dict(), batch1_tokens=b1check.to_dict())
    out["errors"] = sorted({r.error for r in records if r.error})[:5]
    bad = [f"{label}: {c.describe()}" for label, c in ((f"c={a.concurrency}", check), ("batch-1", b1check)) if not c.ok]
    note = "; ".join(bad) or "ok"
    out["summary"] = {
        "output_tok_s": main["output_throughput"] if main["completed"] else None,
        "ttft_p50_ms": main["ttft"]["percentiles_ms"]["p50"], "ttft_p99_ms": main["ttft"]["percentiles_ms"]["p99"],
        "tpot_p50_ms": main["tpot"]["percentiles_ms"]["p50"],
        "batch1_ms_per_token": b1["tpot"]["median_ms"] if b1["completed"] else None,
        "rss_mib": out["rss_mib"], "tokens_ok": check.ok and b1check.ok, "token_note": note,
        "batch1_floor_ms": batch1_floor_ms(model_cfg, machine, config.precision,
                                           a.batch1_input_len + a.batch1_output_len // 2),
        "ceiling_tok_s": workload_ceiling(model_cfg, machine, config.precision, main_reqs),
        "bandwidth_gbs": machine.sum_gbs,  # the read rate the floors use (compare_floors.py)
    }  # fmt: skip
    return out


def _counters(base_url: str) -> dict[str, float] | None:
    try:
        return probe.scrape(base_url)
    except Exception:  # a peer without /metrics: no step accounting for it
        return None


def _step_accounting(before, after) -> dict | None:
    """Where the c=N run's decode steps went, for servers exposing pagemill's counters."""
    if not before or not after or probe.STEPS not in after:
        return None
    o = probe.overhead_between(before, after).to_dict()
    gen = after.get(probe.GENERATED, 0.0) - before.get(probe.GENERATED, 0.0)
    o["mean_tokens_per_step"] = gen / o["decode_steps"] if o["decode_steps"] else 0.0
    return o


def workload_requests(a, tok):
    main = uniform_dataset(tok, a.num_prompts, a.input_min, a.input_max, a.output_min, a.output_max, a.seed)
    b1 = uniform_dataset(tok, a.batch1_prompts, a.batch1_input_len, a.batch1_input_len, a.batch1_output_len,
                         a.batch1_output_len, a.seed + 1)  # fmt: skip
    # Unlike the measured prompts, so no server starts with them in a prefix cache.
    w = uniform_dataset(tok, min(8, a.concurrency), 32, 64, 8, 8, a.seed + 2)
    return main, b1, w


def run_compare(a) -> dict:
    from tokenizers import Tokenizer

    from pagemill.bench.cli import resolve_model_dir

    cpu = cpu_info()
    configs = select(a.servers, set(cpu["flags"]), a.pagemill, a.server, resolve_args(a))
    model_dir = resolve_model_dir(a.model_dir)
    model_cfg = ModelConfig.from_model_dir(model_dir)
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    main_reqs, b1_reqs, warm_reqs = workload_requests(a, tok)
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    values = placeholders(os.path.abspath(a.peers_dir), model_dir, a.port)
    res = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpu": cpu, "args": vars(a), "model_dir": model_dir,
           "command": "pagemill " + shlex.join(sys.argv[1:]), "throughput_ref": a.throughput_ref,
           "latency_refs": a.latency_refs.split(","),
           "servers": [{"name": c.name, "precision": c.precision, "command": c.argv(values),
                        "env": c.environment(values), "runs": []} for c in configs]}  # fmt: skip
    _log(rep.cpu_line(cpu))
    # A SIGTERM (e.g. `timeout`) unwinds like Ctrl-C: the running server's
    # whole tree is stopped on the way out, not left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for run in range(a.runs):
        for c, entry in zip(configs, res["servers"]):
            _log(f"run {run + 1}/{a.runs}: {c.name}")
            try:
                r = one_run(c, values, a, main_reqs, b1_reqs, warm_reqs,
                            os.path.join(a.out, "logs", f"{c.name}-run{run + 1}.log"), model_cfg)  # fmt: skip
                s = r["summary"]
                _log(f"  {s['output_tok_s'] or 0:.1f} out tok/s, TTFT p50/p99 {s['ttft_p50_ms']:.0f}/"
                     f"{s['ttft_p99_ms']:.0f} ms, TPOT p50 {s['tpot_p50_ms']:.1f} ms, batch-1 "
                     f"{s['batch1_ms_per_token'] or 0:.1f} ms/token, RSS {s['rss_mib']:.0f} MiB, tokens {s['token_note']}")  # fmt: skip
            except Exception as e:  # one broken server must not lose the others' figures
                _log(f"  failed: {type(e).__name__}: {e}")
                r = {"failed": f"{type(e).__name__}: {e}"}
            entry["runs"].append(r)
            write(res, a.out, a.merge, record=False)
    return write(res, a.out, a.merge)


def write(res: dict, out: str, merge: str | None = None, record: bool = True) -> dict:
    """The latest run's files in `out` (compare.json, compare.md, compare.png: replaced by each
    call, so they show whatever runs exist so far) and, with `record`, one row of its headline
    figures appended to `out`/history.jsonl (bench/history.py): the run's record over time."""
    servers = list(res["servers"])
    if merge:  # servers of an earlier compare that this one did not re-run
        with open(merge) as f:
            old = json.load(f)
        names = {s["name"] for s in servers}
        servers += [{**s, "merged_from": merge} for s in old["servers"] if s["name"] not in names]
    for s in servers:
        s["summary"] = rep.median_summary([r["summary"] for r in s["runs"] if "summary" in r])
    res["read_bandwidth_gbs"] = rep.floors_at_median_bandwidth(servers)
    res["servers"] = [s for s in servers]
    summaries = {s["name"]: s["summary"] for s in servers}
    refs = tuple(res["latency_refs"])
    res["ratios"] = rep.ratios(summaries, res["throughput_ref"], refs)
    table = rep.markdown_table(servers, res["ratios"], res["throughput_ref"], refs, res["args"]["concurrency"])
    with open(os.path.join(out, "compare.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(os.path.join(out, "compare.md"), "w") as f:
        f.write(rep.summary_markdown(res, table))
    try:
        from pagemill.bench.compare_plot import compare_plot

        compare_plot(servers, rep.cpu_line(res["cpu"]), res["args"]["concurrency"], os.path.join(out, "compare.png"))
    except ImportError as e:  # matplotlib is in the optional `bench` extra
        _log(f"no plot: {e}")
    if record:
        path = history.append_history(out, history.history_row(res, history.git_commit()))
        _log(f"history: {path}")
    return res
