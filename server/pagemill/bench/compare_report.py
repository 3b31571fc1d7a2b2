"""Pure parts of `pagemill bench compare`: token-count checks, medians over
runs, ratios against the peers, the markdown table and the CPU's flags."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

# Flags that decide which kernels a server can use; printed with every figure.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")  # fmt: skip

# Columns reported per server: key in a run's summary -> how runs combine.
SUMMARY_KEYS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "batch1_ms_per_token", "rss_mib",
                "batch1_floor_ms", "bandwidth_gbs", "ceiling_tok_s")

# Bytes per weight of each precision a server can run at, for the batch-1
# memory floor (GGUF Q4_1: 32 weights in 16 bytes of nibbles + two fp16s;
# Q8_0: 32 int8 + one fp16; our int8: one byte + a float scale per 576+ row).
WEIGHT_BYTES = {"fp32": 4.0, "float32": 4.0, "bf16": 2.0, "bfloat16": 2.0, "fp16": 2.0, "int8": 1.0,
                "q8_0": 34 / 32, "q4_1": 20 / 32, "q4_0": 18 / 32,
                # Q4_K_M mixes Q4_K (144 bytes a 256-weight block) with larger types: Q4_K's size is its floor.
                "q4_k_m": 144 / 256}  # fmt: skip


@dataclass
class TokenCheck:
    """Did the server generate what each request asked for (ignore-EOS)?"""

    requests: int
    short: int  # requests that got fewer tokens than asked
    long: int  # requests that got more (a server ignoring max_tokens)
    expected_tokens: int
    got_tokens: int

    @property
    def ok(self) -> bool:
        return self.short == 0 and self.long == 0 and self.requests > 0

    def describe(self) -> str:
        if self.ok:
            return "ok"
        parts = []
        if self.short:
            parts.append(f"{self.short}/{self.requests} short")
        if self.long:
            parts.append(f"{self.long}/{self.requests} long")
        if not self.requests:
            parts.append("no requests")
        pct = 100.0 * self.got_tokens / self.expected_tokens if self.expected_tokens else 0.0
        return f"{', '.join(parts)} ({pct:.0f}% of tokens)"

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "describe": self.describe()}


def check_tokens(expected: list[int], got: list[int | None]) -> TokenCheck:
    """expected[i]: tokens request i asked for; got[i]: tokens it produced
    (the server's usage count, else counted stream chunks; None: failed)."""
    if len(expected) != len(got):
        raise ValueError(f"{len(expected)} requests but {len(got)} results")
    g = [x or 0 for x in got]
    return TokenCheck(
        requests=len(expected),
        short=sum(1 for e, x in zip(expected, g) if x < e),
        long=sum(1 for e, x in zip(expected, g) if x > e),
        expected_tokens=sum(expected),
        got_tokens=sum(g),
    )


def median_summary(runs: list[dict]) -> dict:
    """Median of every summary value over runs (keys missing from a run are skipped)."""
    out = {}
    for key in SUMMARY_KEYS:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    out["runs"] = len(runs)
    out["tokens_ok"] = all(r.get("tokens_ok", False) for r in runs) if runs else False
    out["token_notes"] = sorted({r["token_note"] for r in runs if r.get("token_note", "ok") != "ok"})
    return out


def floors_at_median_bandwidth(servers: list[dict]) -> float | None:
    """Sets each server's batch-1 floor to its weights read at the median read bandwidth of every
    run of the comparison (one machine, one figure), and returns that bandwidth. Why not each
    run's own: single readings spiked (32 -> 54 GB/s on the reference machine) without decode
    getting any faster, and a server's median of three could land on a spike. Each run's floor
    is bytes / its bandwidth, so rescaling by the bandwidths gives bytes / the median."""
    bws = [r["machine"]["sum_gbs"] for s in servers for r in s["runs"] if "machine" in r]
    if not bws:
        return None
    bw = statistics.median(bws)
    for s in servers:
        floors = [r["summary"]["batch1_floor_ms"] * r["machine"]["sum_gbs"] / bw for r in s["runs"]
                  if "machine" in r and (r.get("summary") or {}).get("batch1_floor_ms")]  # fmt: skip
        s["summary"]["batch1_floor_ms"] = statistics.median(floors) if floors else None
    return bw


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def ratios(summaries: dict[str, dict], throughput_ref: str, latency_refs: tuple[str, ...]) -> dict[str, dict]:
    """Per server: output tok/s over the throughput reference's, and batch-1
    time per token over each latency reference's (below 1 is better)."""
    out = {}
    ref_t = (summaries.get(throughput_ref) or {}).get("output_tok_s")
    for name, s in summaries.items():
        r = {f"tok_s_vs_{throughput_ref}": ratio(s.get("output_tok_s"), ref_t)}
        r["b1_vs_floor"] = ratio(s.get("batch1_ms_per_token"), s.get("batch1_floor_ms"))
        for ref in latency_refs:
            r[f"b1_vs_{ref}"] = ratio(s.get("batch1_ms_per_token"), (summaries.get(ref) or {}).get("batch1_ms_per_token"))
        out[name] = r
    return out


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def markdown_table(rows: list[dict], ratio_rows: dict[str, dict], throughput_ref: str,
                   latency_refs: tuple[str, ...], concurrency: int = 64) -> str:  # fmt: skip
    """rows: {name, precision, summary}; one line per server, in run order."""
    head = ["server", "precision", f"out tok/s c={concurrency}", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
            "batch-1 ms/token", "batch-1 floor ms", "batch-1 vs floor", "RSS MiB", f"tok/s vs {throughput_ref}",
            *[f"batch-1 vs {r}" for r in latency_refs], "output tokens"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "| --- | --- | " + " | ".join(["---:"] * (len(head) - 3)) + " | --- |"]
    for row in rows:
        s, r = row["summary"], ratio_rows.get(row["name"], {})
        check = "no run finished" if not s["runs"] else "all requested" if s["tokens_ok"] else "**SHORT: " + "; ".join(s["token_notes"] or ["?"]) + "**"
        cells = [row["name"], row["precision"], _f(s["output_tok_s"], ".1f"), _f(s["ttft_p50_ms"], ".0f"),
                 _f(s["ttft_p99_ms"], ".0f"), _f(s["tpot_p50_ms"], ".1f"), _f(s["batch1_ms_per_token"], ".1f"),
                 _f(s.get("batch1_floor_ms"), ".1f"), _x(r.get("b1_vs_floor")), _f(s["rss_mib"], ".0f"), _x(r.get(f"tok_s_vs_{throughput_ref}")),
                 *[_x(r.get(f"b1_vs_{ref}")) for ref in latency_refs], check]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_cpuinfo(text: str) -> dict:
    """Model name, logical CPUs and the kernel-relevant flags from /proc/cpuinfo."""
    model, flags, cpus = "", set(), 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            cpus += 1
        elif key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return {"model": model, "cpus": cpus, "flags": [f for f in KERNEL_FLAGS if f in flags],
            "missing": [f for f in KERNEL_FLAGS if f not in flags]}  # fmt: skip


def cpu_line(cpu: dict) -> str:
    return f"{cpu['model']} ({cpu['cpus']} CPUs): {' '.join(cpu['flags']) or 'none of ' + ' '.join(KERNEL_FLAGS)}" + (
        f"; no {' '.join(cpu['missing'])}" if cpu["missing"] else "")  # fmt: skip


def summary_markdown(res: dict, table: str) -> str:
    a = res["args"]
    runs = [len([r for r in s["runs"] if "summary" in r]) for s in res["servers"]]
    lines = [f"# pagemill bench compare ({res['started']})", "",
             f"CPU: {cpu_line(res['cpu'])}", "",
             f"Workload: {a['num_prompts']} requests at {a['concurrency']} concurrent, prompts {a['input_min']}-"
             f"{a['input_max']} tokens, outputs {a['output_min']}-{a['output_max']} tokens (ignore EOS), seed "
             f"{a['seed']}; batch-1: {a['batch1_prompts']} sequential requests of "
             f"{a.get('batch1_input_len', 64)} prompt + {a['batch1_output_len']} output tokens. Medians of {min(runs, default=0)}-{max(runs, default=0)} "
             "fresh-start runs per server; RSS: the whole process tree after warm-up.", "",
             table, "", f"Command: `{res['command']}`", ""]  # fmt: skip
    loads = [f"{s['name']} " + "/".join(f"{r['load_before']:.1f}" for r in s["runs"] if "load_before" in r)
             for s in res["servers"]]  # fmt: skip
    lines += ["1-min load average before each run (2 cores; other work on the machine distorts every figure): "
              + ", ".join(loads), ""]  # fmt: skip
    busy = {s["name"]: [r["busy_cpus_before"] for r in s["runs"] if r.get("busy_cpus_before") is not None]
            for s in res["servers"]}  # fmt: skip
    if any(busy.values()):  # (runs from before the figure have none)
        lines += ["Busy CPUs over the 2 s before each start (/proc/stat; the load average above still shows "
                  "the previous server's run): " + ", ".join(f"{n} " + "/".join(f"{b:.2f}" for b in v)
                                                             for n, v in busy.items()), ""]  # fmt: skip
    ceilings = [f"{s['name']} {s['summary']['ceiling_tok_s']:.0f} tok/s (measured {s['summary']['output_tok_s'] or 0:.0f}, "
                f"{(s['summary']['output_tok_s'] or 0) / s['summary']['ceiling_tok_s']:.0%})"
                for s in res["servers"] if s["summary"].get("ceiling_tok_s")]  # fmt: skip
    if ceilings:
        lines += ["The c=%d workload's roofline ceiling on this machine (every step at the bandwidth and the bf16 or "
                  "fp32 GEMM rate measured before each run; bench/workload_floor.py): " % a["concurrency"]
                  + ", ".join(ceilings), ""]  # fmt: skip
    if res.get("read_bandwidth_gbs"):
        lines += [f"Batch-1 floors: every weight read once at {res['read_bandwidth_gbs']:.1f} GB/s, the median of "
                  "the read bandwidths below.", ""]  # fmt: skip
    lines += ["Read bandwidth (512 MiB in huge pages, the faster of torch's sum and a compiled read; idle) "
              "before each run, GB/s: " + ", ".join(
        s["name"] + " " + "/".join(f"{r['machine']['sum_gbs']:.1f}" for r in s["runs"] if "machine" in r)
        for s in res["servers"])] if any("machine" in r for s in res["servers"] for r in s["runs"]) else []  # fmt: skip
    failed = [(s["name"], r["failed"]) for s in res["servers"] for r in s["runs"] if "failed" in r]
    if failed:
        lines += ["Failed runs:", "", *[f"- {n}: {e}" for n, e in failed], ""]
    return "\n".join(lines)
