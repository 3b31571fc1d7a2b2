"""Router and shard options are declared once (RouterConfig in router/src/config.rs,
ShardConfig in server/pagemill/config.py); the CLI is generated from them."""

from __future__ import annotations

import dataclasses
import re

import pytest

from pagemill.cli import build_parser, main, router_table, shard_config
from pagemill.config import ShardConfig
from pagemill.launcher import Launcher
from pagemill.options import dataclass_argv

# Every flag the CLI had before the options were generated (docs, tests and scripts use them).
LEGACY_SHARD_FLAGS = ["--dtype", "--device", "--block-size", "--kv-cache-memory", "--gpu-memory-utilization",
                      "--attention", "--num-threads", "--speculate", "--speculate-method", "--draft-model",
                      "--cpu-kernels", "--no-cpu-kernels", "--cuda-graphs", "--no-cuda-graphs", "--quantize",
                      "--kv-cache-dtype", "--master-port"]  # fmt: skip
LEGACY_SHARD_ONLY_FLAGS = ["--model-dir", "--uds-path", "--rank", "--world-size", "--master-addr", "--local-rank",
                           "--dist-timeout"]  # fmt: skip
LEGACY_ROUTER_FLAGS = ["--hostname", "--port", "--max-input-tokens", "--max-total-tokens", "--max-batch-prefill-tokens",
                       "--prefill-chunk-tokens", "--max-num-batched-tokens", "--max-batch-total-tokens",
                       "--max-batch-size", "--max-concurrent-requests", "--max-stop-sequences", "--max-top-n-tokens",
                       "--default-max-new-tokens", "--max-best-of", "--api-key", "--payload-limit",
                       "--shutdown-timeout", "--max-queue-wait-ms", "--log-level", "--no-prefix-caching",
                       "--cache-aware-admission"]  # fmt: skip

needs_router = pytest.mark.skipif(not router_table(), reason="pagemill._router not built (or without options())")


def _help(*argv: str, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _lists(help_text: str, flag: str) -> bool:
    return re.search(rf"(^|[\s\[]){re.escape(flag)}([\s,\]=]|$)", help_text, re.M) is not None


def _error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def _shard(*flags: str) -> ShardConfig:
    a = build_parser().parse_args(["shard", "--model-dir", "m", "--uds-path", "s", *flags])
    return shard_config(a, a.model_dir, a.uds_path, a.rank, a.world_size)


def test_shard_defaults_are_the_dataclass_defaults(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert _shard() == ShardConfig(model_dir="m", uds_path="s")
    launch = build_parser().parse_args(["launch"])
    assert shard_config(launch, "m", "s", 0, 1) == ShardConfig(model_dir="m", uds_path="s")


def test_shard_flags_round_trip():
    cfg = _shard("--dtype", "bfloat16", "--device", "cuda", "--block-size", "32", "--kv-cache-memory", "512MiB",
                 "--gpu-memory-utilization", "0.5", "--attention", "torch", "--num-threads", "3", "--speculate", "2",
                 "--speculate-method", "draft", "--draft-model", "/d", "--no-cuda-graphs", "--no-cpu-kernels",
                 "--quantize", "int8", "--kv-cache-dtype", "fp8_e5m2", "--rank", "1", "--world-size", "2",
                 "--master-addr", "10.0.0.1", "--master-port", "1234", "--local-rank", "1",
                 "--dist-timeout", "9.5", "--no-huge-pages")  # fmt: skip
    assert cfg.kv_cache_memory == 512 << 20 and cfg.cuda_graphs is False and cfg.dist_timeout_s == 9.5
    assert cfg.huge_pages is False and ShardConfig(model_dir="m", uds_path="u").huge_pages is True
    assert cfg.rank == 1 and cfg.world_size == 2 and cfg.local_rank == 1 and cfg.quantize == "int8"
    # What the launcher does: a ShardConfig as flags, parsed back by `pagemill shard`.
    for c in (cfg, ShardConfig(model_dir="-m", uds_path="/tmp/x.sock")):
        a = build_parser().parse_args(["shard", *dataclass_argv(c)])
        assert shard_config(a, a.model_dir, a.uds_path, a.rank, a.world_size) == c


def test_shard_env_defaults(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "777")
    cfg = _shard()
    assert (cfg.rank, cfg.world_size, cfg.local_rank, cfg.master_port) == (3, 4, 1, 777)
    assert _shard("--rank", "0").rank == 0
    assert build_parser().parse_args(["launch"]).master_port == 29500  # launch ignores the shard environment


def test_every_shard_option_is_offered_with_help(capsys):
    launch, shard = _help("launch", capsys=capsys), _help("shard", capsys=capsys)
    # A per-process shard option may share its flag with a router option that `launch` offers
    # (--shard-auth-token-file: the router's, for shard groups it reaches over TCP).
    router_flags = {"--" + row["flag"] for row in router_table()}
    for f in dataclasses.fields(ShardConfig):
        flag = "--" + (f.metadata["flag"] or f.name.replace("_", "-"))
        assert f.metadata["help"]
        assert _lists(shard, flag), flag
        if f.metadata["per_process"]:
            assert not _lists(launch, flag) or flag in router_flags, flag
        else:
            assert _lists(launch, flag), flag
    for flag in LEGACY_SHARD_FLAGS:
        assert _lists(launch, flag) and _lists(shard, flag), flag
    for flag in LEGACY_SHARD_ONLY_FLAGS:
        assert _lists(shard, flag), flag


def test_bad_shard_values_name_the_flag(capsys):
    assert "--block-size" in _error(["launch", "--block-size", "many"], capsys)
    assert "not a size" in _error(["launch", "--kv-cache-memory", "3 furlongs"], capsys)
    assert "invalid choice" in _error(["launch", "--dtype", "int3"], capsys)
    assert "--model-dir" in _error(["shard", "--uds-path", "s"], capsys)


@needs_router
def test_every_router_option_is_offered_with_help(capsys):
    launch, router = _help("launch", capsys=capsys), _help("router", capsys=capsys)
    for row in router_table():
        assert row["help"], row
        assert _lists(router, "--" + row["flag"]), row
        assert row["launcher_sets"] or _lists(launch, "--" + row["flag"]), row  # the launcher sets the others
    for flag in LEGACY_ROUTER_FLAGS:
        assert _lists(launch, flag) and _lists(router, flag), flag
    assert not _lists(launch, "--shard-uds-path") and not _lists(launch, "--tokenizer-dir")


def _launcher(*flags: str) -> Launcher:
    return Launcher(build_parser().parse_args(["launch", *flags]))


@needs_router
def test_launch_forwards_router_options(monkeypatch):
    monkeypatch.delenv("PAGEMILL_API_KEY", raising=False)
    launcher = _launcher("--port", "8080", "--api-key", "sekrit", "--no-prefix-caching", "--payload-limit", "1MiB",
                         "--max-num-batched-tokens", "0", "--prefill-chunk-tokens", "256", "--model-id", "m1",
                         "--shutdown-timeout", "60")
    argv, env = launcher._router_args("/models/x", [["/s0", "/s1"]])
    assert env == {"PAGEMILL_API_KEY": "sekrit"} and not any("sekrit" in f for f in argv)  # not visible in `ps`
    assert argv[argv.index("--port") + 1] == "8080" and "--no-prefix-caching" in argv
    assert argv[argv.index("--model-id") + 1] == "m1"
    r = launcher.router
    assert (r["port"], r["api_key"], r["prefix_caching"], r["payload_limit"]) == (8080, "sekrit", False, 1 << 20)
    assert (r["max_num_batched_tokens"], r["prefill_chunk_tokens"], r["shutdown_timeout_s"]) == (None, 256, 60)
    assert r["shard_uds_paths"] == ["/s0", "/s1"] and r["tokenizer_dir"] == "/models/x"
    # --data-parallel 2: one --shard-group per group, ranks in order.
    launcher._router_args("/models/x", [["/a0", "/a1"], ["/b0", "/b1"]])
    assert launcher.router["shard_groups"] == ["/a0,/a1", "/b0,/b1"] and launcher.router["shard_uds_paths"] == []
    # --data-parallel 2: one --shard-group per group, ranks in order.
    launcher._router_args("/models/x", [["/a0", "/a1"], ["/b0", "/b1"]])
    assert launcher.router["shard_groups"] == ["/a0,/a1", "/b0,/b1"] and launcher.router["shard_uds_paths"] == []
    # Defaults come from the router's declaration.
    defaults = _launcher()
    defaults._router_args("/models/x", ["/s"])
    r = defaults.router
    assert (r["hostname"], r["port"], r["shutdown_timeout_s"], r["model_id"]) == ("127.0.0.1", 3000, 30, "x")


@needs_router
def test_empty_api_key_env_means_no_key(monkeypatch):
    monkeypatch.setenv("PAGEMILL_API_KEY", "")
    launcher = _launcher()
    launcher._router_args("/m", ["/s"])
    assert launcher.router["api_key"] is None


@needs_router
def test_bad_router_values_fail_before_any_shard_starts(capsys):
    for flags, needle in ((["--port", "abc"], "--port"), (["--max-input-tokens", "-1"], "--max-input-tokens"),
                          (["--payload-limit", "2 parsecs"], "not a size"),
                          (["--max-input-tokens", "4096"], "max_input_tokens")):  # fmt: skip
        with pytest.raises(ValueError, match=needle):
            _launcher(*flags)._router_args("/m", ["/s"])
    # `pagemill router` parses with the same parser and exits 2 without serving.
    for argv, needle in ((["--tokenizer-dir", "/m", "--port", "x"], "--port"), (["--tokenizer-dir", "/m"], "socket")):
        with pytest.raises(SystemExit) as e:
            main(["router", *argv])
        assert e.value.code == 2 and needle in capsys.readouterr().err
