"""The pure parts of `pagemill bench compare` (no peer servers needed)."""

from __future__ import annotations

import pytest

from pagemill.bench import compare_report as rep
from pagemill.bench.peer_configs import DEFAULT_SERVERS, parse_spec, presets, select

CPUINFO = """processor\t: 0
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_vnni
processor\t: 1
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_vnni
"""


def test_token_check_counts_short_and_long_requests():
    c = rep.check_tokens([16, 100, 256, 40], [16, 37, 256, 41])
    assert (c.requests, c.short, c.long) == (4, 1, 1)
    assert (c.expected_tokens, c.got_tokens) == (412, 350)
    assert not c.ok
    assert "1/4 short" in c.describe() and "1/4 long" in c.describe() and "85% of tokens" in c.describe()


def test_token_check_failed_request_counts_as_short():
    c = rep.check_tokens([10, 10], [10, None])
    assert c.short == 1 and c.got_tokens == 10 and not c.ok


def test_token_check_all_exact_is_ok_and_empty_is_not():
    assert rep.check_tokens([5, 7], [5, 7]).describe() == "ok"
    assert not rep.check_tokens([], []).ok
    with pytest.raises(ValueError):
        rep.check_tokens([1, 2], [1])


def _run(tok_s, b1, ok=True, note="ok", rss=500.0, floor=10.0):
    return {"output_tok_s": tok_s, "ttft_p50_ms": 100.0, "ttft_p99_ms": 900.0, "tpot_p50_ms": 50.0,
            "batch1_ms_per_token": b1, "rss_mib": rss, "tokens_ok": ok, "token_note": note,
            "batch1_floor_ms": floor, "bandwidth_gbs": 30.0}  # fmt: skip


def test_median_summary_over_runs_and_token_flags():
    s = rep.median_summary([_run(300, 30), _run(100, 20, ok=False, note="c=64: 3/64 short"), _run(200, 40)])
    assert s["output_tok_s"] == 200 and s["batch1_ms_per_token"] == 30 and s["runs"] == 3
    assert not s["tokens_ok"] and s["token_notes"] == ["c=64: 3/64 short"]
    # an even count takes the mean of the middle two; a missing value is skipped
    s = rep.median_summary([_run(300, None), _run(100, 20)])
    assert s["output_tok_s"] == 200 and s["batch1_ms_per_token"] == 20
    assert rep.median_summary([])["output_tok_s"] is None


def test_ratios_against_the_references():
    sums = {"pm": rep.median_summary([_run(600, 16)]), "vllm-bf16": rep.median_summary([_run(400, 32)]),
            "llamacpp-bf16": rep.median_summary([_run(50, 20)])}  # fmt: skip
    r = rep.ratios(sums, "vllm-bf16", ("llamacpp-bf16", "llamacpp-q4_1"))
    assert r["pm"]["tok_s_vs_vllm-bf16"] == pytest.approx(1.5)
    assert r["pm"]["b1_vs_llamacpp-bf16"] == pytest.approx(0.8)
    assert r["pm"]["b1_vs_llamacpp-q4_1"] is None  # reference not run
    assert r["vllm-bf16"]["tok_s_vs_vllm-bf16"] == pytest.approx(1.0)


def test_markdown_table_flags_short_outputs():
    rows = [{"name": "pagemill-bf16", "precision": "bf16",
             "summary": rep.median_summary([_run(307.1, 31.6, ok=False, note="c=64: 60/64 short (40% of tokens)")])},
            {"name": "vllm-bf16", "precision": "bf16", "summary": rep.median_summary([_run(635.6, 28.8)])}]  # fmt: skip
    sums = {r["name"]: r["summary"] for r in rows}
    table = rep.markdown_table(rows, rep.ratios(sums, "vllm-bf16", ("llamacpp-bf16",)), "vllm-bf16", ("llamacpp-bf16",))
    lines = table.splitlines()
    assert len(lines) == 4 and all(line.count("|") == lines[0].count("|") for line in lines)
    assert "| pagemill-bf16 | bf16 | 307.1 |" in lines[2]
    assert "0.48x" in lines[2] and "**SHORT: c=64: 60/64 short (40% of tokens)**" in lines[2]
    assert "1.00x" in lines[3] and "all requested" in lines[3]
    assert lines[3].count("| - |") == 1  # no llama.cpp figure to compare with


def test_batch1_against_its_memory_floor():
    from pagemill.bench.compare_floors import batch1_floor_ms
    from pagemill.bench.roofline import Machine
    from pagemill.models.config import ModelConfig

    cfg = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "vocab_size": 1000, "max_position_embeddings": 256})  # fmt: skip
    # the read rate (sum) is the floor's, not the copy's nor their max
    m = Machine(threads=2, copy_gbs=3.0, sum_gbs=1.0, bandwidth_gbs=3.0, matmul_gflops=1.0)
    bf16, int8, fp32 = (batch1_floor_ms(cfg, m, p, 100) for p in ("bf16", "int8", "fp32"))
    # weights: 2 layers of (64 x (64 + 2 * 32) + 64 x 64 + 3 x 64 x 128) + the 1000 x 64 head, norms, KV of 100 tokens
    weights = 2 * (64 * 128 + 64 * 64 + 3 * 64 * 128) + 1000 * 64 + 2 * 2 * 64
    kv = 100 * 2 * 2 * 32
    assert bf16 == pytest.approx((weights + kv) * 2 / 1e9 * 1e3)
    assert fp32 == pytest.approx(2 * bf16) and int8 == pytest.approx(bf16 / 2)
    assert batch1_floor_ms(cfg, m, "mystery", 100) is None
    runs = [_run(300, 12.0, floor=10.0), _run(310, 13.0, floor=9.0), _run(320, 14.0, floor=11.0)]
    s = rep.median_summary(runs)
    assert s["batch1_floor_ms"] == 10.0 and s["bandwidth_gbs"] == 30.0
    r = rep.ratios({"pm": s}, "pm", ())
    assert r["pm"]["b1_vs_floor"] == pytest.approx(1.3)
    table = rep.markdown_table([{"name": "pm", "precision": "bf16", "summary": s}], r, "pm", ())
    assert "batch-1 floor ms | batch-1 vs floor" in table and "| 13.0 | 10.0 | 1.30x |" in table


def test_batch1_floors_use_the_median_bandwidth_of_all_runs():
    def run(floor, bw):
        return {"summary": {**_run(300, 12.0, floor=floor)}, "machine": {"sum_gbs": bw}}

    # 270 MB of weights: 9 ms at 30 GB/s; one spiky reading (54 GB/s) must not set the floor
    servers = [{"name": "a", "runs": [run(270 / 30, 30.0), run(270 / 54, 54.0), run(270 / 50, 50.0)]},
               {"name": "b", "runs": [run(270 / 29, 29.0), run(270 / 31, 31.0), {"failed": "x"}]}]  # fmt: skip
    for s in servers:
        s["summary"] = rep.median_summary([r["summary"] for r in s["runs"] if "summary" in r])
    assert rep.floors_at_median_bandwidth(servers) == 31.0  # median of 30, 54, 50, 29, 31
    assert servers[0]["summary"]["batch1_floor_ms"] == pytest.approx(270 / 31)
    assert servers[1]["summary"]["batch1_floor_ms"] == pytest.approx(270 / 31)
    assert rep.floors_at_median_bandwidth([{"name": "c", "runs": [{"failed": "x"}], "summary": {}}]) is None


def test_workload_ceiling_is_the_continuous_floor_at_the_precisions_gemm_rate():
    from types import SimpleNamespace

    from pagemill.bench.compare_floors import workload_ceiling
    from pagemill.bench.roofline import Machine
    from pagemill.bench.workload_floor import continuous_floor
    from pagemill.models.config import ModelConfig

    cfg = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "vocab_size": 1000, "max_position_embeddings": 256})  # fmt: skip
    reqs = [SimpleNamespace(prompt_len=p, output_len=o) for p, o in ((32, 16), (200, 64), (90, 40))]
    m = Machine(threads=2, copy_gbs=1.0, sum_gbs=1.0, bandwidth_gbs=1.0, matmul_gflops=0.001, matmul_bf16_gflops=0.004)
    bf16 = workload_ceiling(cfg, m, "bf16", reqs)
    fp32 = workload_ceiling(cfg, m, "fp32", reqs)
    fast = Machine(threads=2, copy_gbs=1.0, sum_gbs=1.0, bandwidth_gbs=1.0, matmul_gflops=0.004)
    assert bf16 == pytest.approx(continuous_floor(cfg, fast, [32, 200, 90], [16, 64, 40], 2).throughput_ceiling)
    assert fp32 == pytest.approx(continuous_floor(cfg, m, [32, 200, 90], [16, 64, 40], 4).throughput_ceiling)
    assert bf16 > fp32 > 0
    assert workload_ceiling(cfg, m, "int8", reqs) is None  # no int8 GEMM rate measured
    old = Machine(threads=2, copy_gbs=1.0, sum_gbs=1.0, bandwidth_gbs=1.0, matmul_gflops=1.0)
    assert workload_ceiling(cfg, old, "bf16", reqs) is None  # a machine record from before bf16 was measured


def test_summary_markdown_states_floors_and_bandwidth():
    s = rep.median_summary([{**_run(300, 12.0), "ceiling_tok_s": 600.0}])
    res = {"started": "now", "cpu": rep.parse_cpuinfo(CPUINFO), "command": "pagemill bench compare",
           "args": {"num_prompts": 64, "concurrency": 64, "input_min": 32, "input_max": 256, "output_min": 16,
                    "output_max": 256, "seed": 0, "batch1_prompts": 4, "batch1_output_len": 128},
           "servers": [{"name": "pm", "summary": s, "runs": [{"load_before": 0.5, "machine": {"sum_gbs": 31.0}}]}]}
    text = rep.summary_markdown(res, "TABLE")
    assert "pm 600 tok/s (measured 300, 50%)" in text and "pm 31.0" in text and "TABLE" in text


def test_parse_cpuinfo_names_the_kernel_flags():
    cpu = rep.parse_cpuinfo(CPUINFO)
    assert cpu["model"] == "AMD EPYC 9R14" and cpu["cpus"] == 2
    assert "avx512_bf16" in cpu["flags"] and "avx512_vnni" in cpu["flags"] and "sse" not in cpu["flags"]
    assert "amx_bf16" in cpu["missing"] and "amx_bf16" not in cpu["flags"]
    assert "no " in rep.cpu_line(cpu) and "amx_int8" in rep.cpu_line(cpu)


def test_default_servers_are_presets_and_fill_their_placeholders():
    configs = select(DEFAULT_SERVERS, set())
    assert [c.name for c in configs] == DEFAULT_SERVERS.split(",")
    values = {"port": "18210", "model_dir": "/m", "peers": "/p", "python": "/py", "threads": "2",
              "last_cpu": "1", "llama_server": "/p/llama-server", "vllm_preload": "/a.so"}  # fmt: skip
    vllm = presets(set())["vllm-bf16"]
    argv = vllm.argv(values)
    assert argv[:3] == ["/p/vllm/bin/vllm", "serve", "/m"] and "bfloat16" in argv and "18210" in argv
    assert vllm.environment(values)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    q4 = presets(set())["llamacpp-q4_1"].argv(values)
    assert q4[0] == "/p/llama-server" and "/p/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" in q4 and "--no-repack" not in q4
    assert "--no-repack" in presets({"amx_int8"})["llamacpp-q4_1"].argv(values)


def test_pagemill_spec_passes_launch_flags_through():
    c = parse_spec("pagemill-int8:int8:--quantize int8 --dtype bfloat16", "pagemill")
    argv = c.argv({"python": "/py", "port": "1", "model_dir": "/m"})
    assert (c.name, c.precision) == ("pagemill-int8", "int8")
    assert argv[:4] == ["/py", "-m", "pagemill", "launch"] and argv[-4:] == ["--quantize", "int8", "--dtype", "bfloat16"]


def test_generic_server_spec_and_errors():
    c = parse_spec("tgi:fp32:my-server --port {port} --model {model_dir}", "server")
    assert c.argv({"port": "9", "model_dir": "/m"}) == ["my-server", "--port", "9", "--model", "/m"]
    with pytest.raises(ValueError, match="port"):
        parse_spec("x:fp32:my-server --model {model_dir}", "server")
    with pytest.raises(ValueError, match="NAME:PRECISION"):
        parse_spec("just-a-name", "pagemill")
    with pytest.raises(ValueError, match="unknown server"):
        select("pagemill-fp32,nope", set())
    with pytest.raises(ValueError, match="twice"):
        select("pagemill-fp32", set(), ["pagemill-fp32:fp32:"])


def test_markdown_table_names_a_server_with_no_finished_run():
    rows = [{"name": "llamacpp-q4_1", "precision": "q4_1", "summary": rep.median_summary([])}]
    table = rep.markdown_table(rows, {}, "vllm-bf16", ("llamacpp-bf16",), concurrency=16)
    assert "out tok/s c=16" in table.splitlines()[0]
    assert "no run finished" in table.splitlines()[2]


def test_batch1_requests_take_the_chosen_prompt_length(default_model_dir):
    from argparse import Namespace
    from pathlib import Path

    from tokenizers import Tokenizer

    from pagemill.bench.compare import workload_requests

    tok = Tokenizer.from_file(str(Path(default_model_dir) / "tokenizer.json"))
    a = Namespace(num_prompts=2, input_min=32, input_max=40, output_min=8, output_max=8, seed=0, concurrency=2,
                  batch1_prompts=3, batch1_input_len=300, batch1_output_len=16)  # fmt: skip
    main, b1, _ = workload_requests(a, tok)
    assert [r.output_len for r in b1] == [16, 16, 16]
    # PromptMaker's text re-encodes to about the asked length (word boundaries may merge tokens).
    assert all(295 <= r.prompt_len <= 300 for r in b1), [r.prompt_len for r in b1]
    assert all(30 <= r.prompt_len <= 40 for r in main)


def test_write_gives_the_json_the_table_and_the_plot(tmp_path):
    """`bench compare`'s outputs from its runs: compare.json, compare.md and compare.png (a real
    PNG drawn by matplotlib, which the test extra installs), a failed run and all."""
    import json

    from pagemill.bench.compare import write

    def server(name, tok_s, b1):
        run = {"summary": _run(tok_s, b1), "machine": {"sum_gbs": 30.0}, "load_before": 0.4}
        return {"name": name, "precision": "bf16", "command": [name], "env": {}, "runs": [run, run]}

    res = {"started": "2026-12-05 20:00:00 UTC", "command": "pagemill bench compare --runs 2",
           "cpu": {"model": "Test CPU", "cpus": 2, "flags": ["avx512_bf16", "amx_bf16"], "missing": []},
           "args": {"num_prompts": 64, "concurrency": 64, "input_min": 32, "input_max": 256, "output_min": 16,
                    "output_max": 256, "seed": 0, "batch1_prompts": 4, "batch1_input_len": 64,
                    "batch1_output_len": 128},
           "throughput_ref": "vllm-bf16", "latency_refs": ["llamacpp-bf16"],
           "servers": [server("pagemill-bf16", 900.0, 14.0), server("vllm-bf16", 600.0, 27.0),
                       server("llamacpp-bf16", 50.0, 18.0)]}  # fmt: skip
    res["servers"][2]["runs"].append({"failed": "TimeoutError: not ready"})
    write(res, str(tmp_path))
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["ratios"]["pagemill-bf16"]["tok_s_vs_vllm-bf16"] == pytest.approx(1.5)
    assert saved["servers"][2]["summary"]["runs"] == 2  # the failed run is not a figure
    table = (tmp_path / "compare.md").read_text()
    assert "| pagemill-bf16 | bf16 | 900.0 |" in table and "Test CPU (2 CPUs): avx512_bf16 amx_bf16" in table
    png = (tmp_path / "compare.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def _compare_result(tok_s: float, started: str) -> dict:
    def server(name, tok, b1):
        run = {"summary": _run(tok, b1), "machine": {"sum_gbs": 30.0}, "load_before": 0.4}
        return {"name": name, "precision": "bf16", "command": [name], "env": {}, "runs": [run]}

    return {"started": started, "command": "pagemill bench compare --runs 1",
            "cpu": {"model": "Test CPU", "cpus": 2, "flags": ["avx2", "fma", "avx512f", "avx512bw", "amx_bf16"],
                    "missing": []},
            "args": {"num_prompts": 64, "concurrency": 64, "input_min": 32, "input_max": 256, "output_min": 16,
                     "output_max": 256, "seed": 0, "batch1_prompts": 4, "batch1_input_len": 64,
                     "batch1_output_len": 128, "runs": 1, "peers_dir": "/opt/pagemill-peers"},
            "throughput_ref": "vllm-bf16", "latency_refs": ["llamacpp-bf16"],
            "servers": [server("pagemill-bf16", tok_s, 12.0), server("vllm-bf16", 600.0, 25.0)]}  # fmt: skip


def test_each_write_replaces_the_latest_files_and_appends_a_history_row(tmp_path, monkeypatch):
    """The results folder keeps one run whole (the latest) and a row per run in history.jsonl."""
    import json

    from pagemill.bench import history
    from pagemill.bench.compare import write

    monkeypatch.setattr(history, "git_commit", lambda path=None: "0123abcd")
    write(_compare_result(900.0, "2026-12-06 10:00:00 UTC"), str(tmp_path))
    write(_compare_result(960.0, "2026-12-07 10:00:00 UTC"), str(tmp_path))
    latest = json.loads((tmp_path / "compare.json").read_text())
    assert latest["started"] == "2026-12-07 10:00:00 UTC"
    assert "| pagemill-bf16 | bf16 | 960.0 |" in (tmp_path / "compare.md").read_text()
    rows = history.read_history(tmp_path / "history.jsonl")
    assert len(rows) == 2
    assert [r["servers"]["pagemill-bf16"]["output_tok_s"] for r in rows] == [900.0, 960.0]
    row = rows[1]
    assert row["commit"] == "0123abcd" and row["date"].endswith("Z")
    assert row["cpu"] == {"model": "Test CPU", "cpus": 2, "flags": ["avx2", "fma", "avx512f", "amx_bf16"]}
    pm = row["servers"]["pagemill-bf16"]
    figures = (pm["ttft_p50_ms"], pm["ttft_p99_ms"], pm["tpot_p50_ms"], pm["batch1_ms_per_token"])
    assert figures == (100.0, 900.0, 50.0, 12.0)
    assert pm["rss_mib"] == 500.0 and pm["runs"] == 1
    assert row["ratios"]["pagemill-bf16"]["tok_s_vs_vllm-bf16"] == pytest.approx(1.6)
    assert row["workload"]["concurrency"] == 64 and "peers_dir" not in row["workload"]
    # a write that does not record (compare's writes between runs) leaves the history alone
    write(_compare_result(990.0, "2026-12-07 11:00:00 UTC"), str(tmp_path), record=False)
    assert len(history.read_history(tmp_path / "history.jsonl")) == 2
    assert json.loads((tmp_path / "compare.json").read_text())["started"] == "2026-12-07 11:00:00 UTC"


def test_history_row_date_is_utc_and_commit_may_be_unknown():
    from datetime import datetime, timedelta, timezone

    from pagemill.bench import history

    when = datetime(2026, 12, 7, 12, 30, tzinfo=timezone(timedelta(hours=2)))
    row = history.history_row(_compare_result(900.0, "x"), None, now=when)
    assert row["date"] == "2026-12-07T10:30:00Z" and row["commit"] is None
    assert history.git_commit("/") is None  # not a pagemill checkout


def test_compare_writes_into_a_stable_folder_by_default():
    import argparse

    from pagemill.bench.cli import add_bench_parser

    p = argparse.ArgumentParser()
    add_bench_parser(p.add_subparsers(dest="command"))
    assert p.parse_args(["bench", "compare"]).out == "benchmarks/results/compare-c64"
