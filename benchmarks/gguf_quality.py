"""Quality of GGUF files served kept quantized, per ggml type, against transformers' dequantized
float32 reference on the same file.

    PYTHONPATH=server python3 benchmarks/gguf_quality.py [--types Q8_0,Q4_0,...] [--prompts 8] [--tokens 16]
    PYTHONPATH=server python3 benchmarks/gguf_quality.py --files a.gguf,b.gguf --text-tokens 256

Files: SmolLM2-135M (the default model's HF directory, ensure_default_model(): its float32
weights are the Q4_1 file's, dequantized) written to F32 and to each type; with llama.cpp's
convert_hf_to_gguf.py + llama-quantize where they are built ($PAGEMILL_PEERS), else with
tests/gguf_writer.py (gguf-py's quantizers, tests/gguf_quants.py's min/max k-quants, and
llama-quantize's fallback types for rows that are not whole 256-value blocks). Plus the real
Gemma 3 270M Q4_K_M as shipped. Per file:
- perplexity of benchmarks/texts/public_domain_en_long.txt (one prefill) for pagemill (kept
  quantized; the compiled kernels where built, else the torch path: the table says which) and
  for the reference (transformers' GGUF loader, float32);
- top-1 agreement with the reference on that text (teacher-forced);
- greedy agreement: N prompts x T greedy tokens, tokens equal to the reference's up to the first
  divergence (mean share) and whole continuations identical.
--files measures the named GGUF files as they are instead (no SmolLM2 files are written);
--text-tokens keeps the first N tokens of the text (a shorter, cheaper perplexity).
Writes benchmarks/results/gguf-quality/latest.json and latest.md (the table) and appends the
run to history.jsonl.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from int8_quality import PROMPTS, Sequence, cpu_flags  # noqa: E402

TEXT = HERE / "texts" / "public_domain_en_long.txt"
OUT = HERE / "results" / "gguf-quality"
PEERS = Path(os.environ.get("PAGEMILL_PEERS", "/opt/pagemill-peers"))  # benchmarks/peers/install.sh's folder
GEMMA = PEERS / "models" / "gemma-3-270m-q4_k_m.gguf"
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K")


def llama_cpp_tools() -> tuple[Path, Path] | None:
    quantize, convert = PEERS / "bin" / "llama-quantize", PEERS / "llama.cpp" / "convert_hf_to_gguf.py"
    return (quantize, convert) if quantize.is_file() and convert.is_file() else None


def make_files(src: Path, out: Path, types: list[str]) -> tuple[dict[str, Path], str]:
    """F32 and each type of `src` (an HF dir) -> paths, and how they were made."""
    out.mkdir(parents=True, exist_ok=True)
    tools = llama_cpp_tools()
    files = {t: out / f"smollm2-135m-{t.lower()}.gguf" for t in ["F32", *types]}
    if tools is not None:
        quantize, convert = tools
        if not files["F32"].is_file():  # files already in --work are reused
            subprocess.run([sys.executable, str(convert), str(src), "--outtype", "f32", "--outfile",
                            str(files["F32"])], check=True)  # fmt: skip
        for t in types:
            if not files[t].is_file():
                subprocess.run([str(quantize), str(files["F32"]), str(files[t]), t], check=True)
        return files, f"llama.cpp: convert_hf_to_gguf.py --outtype f32, then llama-quantize ({quantize})"
    from gguf import GGMLQuantizationType as T
    from gguf_writer import default_types, write_gguf

    from pagemill.models.default_model import find_default_gguf

    vocab = vocab_of(find_default_gguf())
    for t, path in files.items():
        if not path.is_file():
            write_gguf(src, path, vocab, default_types(T[t]), name="SmolLM2 135M Instruct")
    return files, ("pagemill's tests/gguf_writer.py (llama.cpp's layout; gguf-py's quantizers, min/max k-quants, "
                   "llama-quantize's fallback types): llama-quantize is not built here")  # fmt: skip


def vocab_of(path: Path):
    """The tokenizer metadata of a GGUF as tests/gguf_vocab.Vocab (to write the same tokenizer)."""
    from gguf_vocab import Vocab

    from pagemill.models.gguf.reader import GGUFModel

    g = GGUFModel(path)
    v = lambda key: g.value(f"tokenizer.{key}")  # noqa: E731
    ids = {k: v(f"ggml.{key}") for k, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                                               ("unk", "unknown_token_id"), ("pad", "padding_token_id"))}  # fmt: skip
    return Vocab(v("ggml.model"), v("ggml.pre"), v("ggml.tokens"), v("ggml.token_type"), scores=v("ggml.scores"),
                 merges=v("ggml.merges") or [], ids={k: i for k, i in ids.items() if i is not None},
                 add_bos=bool(v("ggml.add_bos_token")), chat_template=v("chat_template"))  # fmt: skip


@torch.no_grad()
def reference_run(path: Path, text: list[int], prompts: list[list[int]], tokens: int) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                              attn_implementation="eager").eval()  # fmt: skip
    logits = model(torch.tensor([text])).logits[0].float()
    outs = []
    for ids in prompts:
        out = model(torch.tensor([ids]), use_cache=True)
        seq = [int(out.logits[0, -1].argmax())]
        for _ in range(tokens - 1):
            out = model(torch.tensor([[seq[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            seq.append(int(out.logits[0, -1].argmax()))
        outs.append(seq)
    return {"logits": logits, "greedy": outs}


@torch.no_grad()
def pagemill_run(path: Path, text: list[int], prompts: list[list[int]], tokens: int, kernels: bool) -> dict:
    from pagemill.models.gguf.linear import GGUFLinear
    from pagemill.models.loader import load_model

    model, config = load_model(str(path), "float32", "cpu", cpu_kernels=kernels)
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    on_kernel = sum(m.prepared is not None for m in linears)
    logits = Sequence(model, config, torch.float32, len(text)).step(text)
    outs = []
    for ids in prompts:
        seq = Sequence(model, config, torch.float32, len(ids) + tokens)
        out = [int(seq.step(ids)[-1].argmax())]
        for _ in range(tokens - 1):
            out.append(int(seq.step([out[-1]])[-1].argmax()))
        outs.append(out)
    path_name = "compiled kernels" if on_kernel == len(linears) else \
        "torch reference" if on_kernel == 0 else f"kernels ({on_kernel}/{len(linears)} linears), rest torch"  # fmt: skip
    return {"logits": logits, "greedy": outs, "path": path_name}


def compare(name: str, path: Path, text: list[int], prompts: list[list[int]], tokens: int, kernels: bool) -> dict:
    from pagemill.models.gguf.reader import GGUFModel

    t0 = time.perf_counter()
    g = GGUFModel(path)
    kinds = collections.Counter(t.type.name for t in g.tensors.values() if len(t.shape) >= 2)
    values = sum(math.prod(t.shape) for t in g.tensors.values())
    ref, ours = reference_run(path, text, prompts, tokens), pagemill_run(path, text, prompts, tokens, kernels)
    target = torch.tensor(text[1:])
    prefix = [next((i for i, (x, y) in enumerate(zip(o, r)) if x != y), tokens) / tokens
              for o, r in zip(ours["greedy"], ref["greedy"])]  # fmt: skip
    return {
        "file": name, "path": str(path), "bytes": g.total_bytes(), "bits_per_weight": 8 * g.total_bytes() / values,
        "matrix_types": dict(kinds), "pagemill_path": ours["path"],
        "ppl_pagemill": math.exp(F.cross_entropy(ours["logits"][:-1], target).item()),
        "ppl_reference": math.exp(F.cross_entropy(ref["logits"][:-1], target).item()),
        "top1_agree": (ours["logits"][:-1].argmax(-1) == ref["logits"][:-1].argmax(-1)).float().mean().item(),
        "greedy_prefix_agree": sum(prefix) / len(prefix),
        "greedy_identical": sum(o == r for o, r in zip(ours["greedy"], ref["greedy"])),
        "seconds": time.perf_counter() - t0,
    }  # fmt: skip


def table(rows: list[dict], prompts: int, tokens: int) -> str:
    lines = ["| file | matrix types | file bits/weight | pagemill path | perplexity (pagemill) | perplexity (reference) | "
             "top-1 agreement | greedy prefix agreement | identical continuations |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rows:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r["matrix_types"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {r['file']} | {kinds} | {r['bits_per_weight']:.2f} | {r['pagemill_path']} | "
                     f"{r['ppl_pagemill']:.3f} | {r['ppl_reference']:.3f} | {r['top1_agree']:.4f} | "
                     f"{r['greedy_prefix_agree']:.3f} | {r['greedy_identical']}/{prompts} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--prompts", type=int, default=8, help="greedy prompts (of int8_quality.py's 8)")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt")
    p.add_argument("--no-gemma", action="store_true", help="skip the real Gemma 3 270M Q4_K_M file")
    p.add_argument("--no-kernels", action="store_true", help="the torch path even where the kernels are built")
    p.add_argument("--work", default="/tmp/pagemill-gguf-quality", help="where the SmolLM2 files are written")
    p.add_argument("--files", default="", help="comma-separated GGUF files to measure instead of the SmolLM2 types")
    p.add_argument("--text-tokens", type=int, default=0, help="the text's first N tokens only (0: all)")
    a = p.parse_args()
    from pagemill.models.default_model import ensure_default_model
    from pagemill.models.gguf.reader import GGUFModel
    from pagemill.models.gguf.tokenizer import build_tokenizer, read_spec

    if a.files:
        runs, made = [(Path(f).name, Path(f)) for f in a.files.split(",") if f], "as shipped (--files)"
    else:
        files, made = make_files(ensure_default_model(), Path(a.work), [t for t in a.types.split(",") if t])
        runs = [(f"SmolLM2-135M {t}", path) for t, path in files.items()]
        if not a.no_gemma and GEMMA.is_file():
            runs.append(("Gemma 3 270M Q4_K_M (as shipped)", GEMMA))
    rows = []
    for name, path in runs:
        tok = build_tokenizer(read_spec(GGUFModel(path), 1 << 20))
        text = tok.encode(TEXT.read_text()).ids
        text = text[: a.text_tokens] if a.text_tokens else text
        prompts = [tok.encode(s).ids for s in PROMPTS[: a.prompts]]
        rows.append({**compare(name, path, text, prompts, a.tokens, not a.no_kernels), "text_tokens": len(text)})
        r = rows[-1]
        print(f"{name}: ppl {r['ppl_pagemill']:.3f} (reference {r['ppl_reference']:.3f}), top-1 {r['top1_agree']:.4f}, "
              f"greedy {r['greedy_prefix_agree']:.3f} / {r['greedy_identical']} identical, {r['pagemill_path']}, "
              f"{r['seconds']:.0f} s", flush=True)  # fmt: skip
    md = table(rows, a.prompts, a.tokens)
    print(md)
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"text": TEXT.name, "prompts": PROMPTS[: a.prompts], "new_tokens": a.tokens, "files_made_by": made,
            "machine": platform.processor() or platform.machine(), "cpu_flags": cpu_flags(),
            "threads": torch.get_num_threads(), "command": " ".join(sys.argv)}  # fmt: skip
    (OUT / "latest.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    with open(OUT / "history.jsonl", "a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **meta, "rows": rows}) + "\n")
    counts = sorted({r["text_tokens"] for r in rows})
    (OUT / "latest.md").write_text(f"{md}\n\nFiles: {made}. Text: {TEXT.name}, the first {'/'.join(map(str, counts))} "
                                   f"tokens; {a.prompts} prompts x {a.tokens} greedy tokens.\n")  # fmt: skip
    print(f"wrote {OUT / 'latest.json'}")


if __name__ == "__main__":
    main()
