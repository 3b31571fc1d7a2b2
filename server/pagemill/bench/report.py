"""Markdown tables of a suite's results (pasted into docs/benchmarks.md)."""

from __future__ import annotations


def _serve_rows(runs: list[dict]) -> list[str]:
    rows = ["| run | conc. | prompts | ok | req/s | out tok/s | total tok/s | goodput req/s | TTFT p50 / p99 ms "
            "| TPOT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 / p99 ms | router overhead |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in runs:
        m = r["metrics"]

        def pq(k):
            s = m[k]
            return f"{s['median_ms']:.0f} / {s['percentiles_ms'].get('p99', 0):.0f}"

        good = "-" if m["goodput"] is None else f"{m['goodput']:.2f}"
        rows.append(
            f"| {r['label']} | {r['max_concurrency']} | {r['num_prompts']} | {m['completed']} | "
            f"{m['request_throughput']:.2f} | {m['output_throughput']:.1f} | {m['total_token_throughput']:.1f} | "
            f"{good} | {pq('ttft')} | {pq('tpot')} | {pq('itl')} | {pq('e2el')} | {100 * r['overhead']['overhead']:.1f}% |"
        )
    return rows


def summary_markdown(res: dict) -> str:
    out = [f"# pagemill bench suite ({res.get('started', '')})", ""]
    if "idle_before" in res:
        out += [f"CPU idle before the run: {100 * res['idle_before']:.0f}%, after: "
                f"{100 * res.get('idle_after', 0):.0f}% (other users of the cores distort every figure)", ""]
    roof = res.get("roofline")
    if roof:
        m = roof["machine"]
        out += ["## Machine (measured)", "",
                f"threads {m['threads']}; copy {m['copy_gbs']:.1f} GB/s, sum {m['sum_gbs']:.1f} GB/s "
                f"(roofline uses {m['bandwidth_gbs']:.1f}); torch.mm {m['matmul_gflops']:.0f} GFLOP/s", "",
                "| batch | context | weight MB | KV MB | GFLOP | memory ms | compute ms | floor ms | binds |",
                "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
        for f in roof["floors"]:
            out.append(f"| {f['batch_size']} | {f['context']} | {f['weight_bytes'] / 1e6:.0f} | {f['kv_bytes'] / 1e6:.1f} | "
                       f"{f['flops'] / 1e9:.1f} | {f['memory_ms']:.1f} | {f['compute_ms']:.1f} | {f['floor_ms']:.1f} | {f['binds']} |")  # fmt: skip
        out.append("")
    if res.get("serve"):
        out += ["## Serving (HTTP, streamed)", "", *_serve_rows(res["serve"]), ""]
    if res.get("overhead_run"):
        o = res["overhead_run"]["overhead"]
        out += ["## Router + scheduler overhead at a full batch", "",
                f"{o['decode_steps']} decode steps: mean step {o['mean_step_ms']:.1f} ms, mean shard forward "
                f"{o['mean_forward_ms']:.1f} ms, overhead 1 - forward/step = {100 * o['overhead']:.1f}%", "",
                *_serve_rows([res["overhead_run"]]), ""]  # fmt: skip
    if res.get("extra"):
        out += ["## Other workloads", "", *_serve_rows(res["extra"]), ""]
    base = res.get("baselines") or []
    if base:
        out += ["## Baselines (same requests, same machine, same run)", "",
                "| baseline | batch | requests | duration s | useful out tokens | computed out tokens | out tok/s |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for b in base:
            out.append(f"| {b['name']} | {b['batch_size']} | {b['num_requests']} | {b['duration_s']:.1f} | "
                       f"{b['total_output_tokens']} | {b['computed_output_tokens']} | {b['output_throughput']:.1f} |")
        out.append("")
    serve = {r["max_concurrency"]: r for r in res.get("serve", [])}
    if roof and (1 in serve or res.get("overhead_run")):
        floors = {f["batch_size"]: f for f in roof["floors"]}
        out += ["## Against the roofline", ""]
        if 1 in serve and 1 in floors:
            tpot = serve[1]["metrics"]["tpot"]["median_ms"]
            out.append(f"- batch 1 over HTTP: TPOT p50 {tpot:.1f} ms = {tpot / floors[1]['floor_ms']:.2f}x the "
                       f"{floors[1]['floor_ms']:.1f} ms floor ({floors[1]['binds']}-bound)")
        o = (res.get("overhead_run") or {}).get("overhead")
        top = (res.get("overhead_run") or {}).get("max_concurrency")
        if o and o["decode_steps"] and top in floors:
            out.append(f"- batch {top}: mean decode step {o['mean_step_ms']:.1f} ms = "
                       f"{o['mean_step_ms'] / floors[top]['floor_ms']:.2f}x the {floors[top]['floor_ms']:.1f} ms floor "
                       f"({floors[top]['binds']}-bound)")
        out.append("")
    if serve and base:
        top = serve[max(serve)]
        tput = top["metrics"]["output_throughput"]
        out += [f"## Ratios (pagemill at concurrency {max(serve)}: {tput:.1f} output tok/s)", ""]
        for b in base:
            out.append(f"- vs {b['name']}: {tput / b['output_throughput']:.2f}x")
        out.append("")
    return "\n".join(out)
