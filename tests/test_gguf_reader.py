"""Reading GGUF files: our header parser against gguf-py's GGUFReader, split sets (gguf-split's
naming and split.* keys), and the errors for what pagemill does not serve (they name it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import build_model_dir
from gguf import GGMLQuantizationType as T, GGUFReader, GGUFWriter
from gguf_vocab import byte_level_vocab
from gguf_writer import _vocab, write_gguf
from test_model import PagedHarness, prompts

from pagemill.models.gguf.archs import hf_config
from pagemill.models.gguf.header import read_header
from pagemill.models.gguf.reader import GGUFModel
from pagemill.models.gguf.types import GGUFError
from pagemill.models.loader import load_model

KW = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(single file, [3 split parts]) of one tiny llama model, mixed Q8_0 / Q4_0 / F32."""
    tmp = tmp_path_factory.mktemp("split")
    model_dir = build_model_dir(str(tmp / "hf"), "l", variants={"l": ("LlamaConfig", KW, {})})

    def types(name, shape):
        return T.F32 if len(shape) < 2 else T.Q4_0 if "ffn" in name else T.Q8_0

    vocab = byte_level_vocab(320)
    (tmp / "one").mkdir()
    (tmp / "three").mkdir()
    (single,) = write_gguf(model_dir, tmp / "one" / "m.gguf", vocab, types)
    parts = write_gguf(model_dir, tmp / "three" / "m.gguf", vocab, types, parts=3)
    return single, parts


def test_header_matches_gguf_py(files):
    single, parts = files
    for path in [single, *parts]:
        ours, theirs = read_header(path), GGUFReader(path)
        assert ours.data_offset == theirs.data_offset
        assert [(t.name, t.offset, t.type_id, tuple(reversed(t.dims))) for t in ours.tensors] == \
            [(t.name, t.data_offset, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape.tolist())))
             for t in theirs.tensors]  # fmt: skip
        for key, field in theirs.fields.items():
            if key.startswith("GGUF."):
                continue
            value = field.contents()
            assert ours.fields[key] == (value.item() if isinstance(value, np.generic) else value), key


def test_split_set_loads_the_same_model(files):
    single, parts = files
    assert [p.name for p in parts] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    g = GGUFModel(parts[1])  # any part finds the set
    assert g.paths == parts and len(g.tensors) == len(GGUFModel(single).tensors)
    assert len({t.part for t in g.tensors.values()}) == 3
    logits = []
    for path in (single, parts[0]):
        model, config = load_model(str(path), "float32", "cpu", cpu_kernels=False)
        logits.append(PagedHarness(model, config).prefill({0: prompts(config.vocab_size, [11])[0]})[0])
    assert torch.equal(logits[0], logits[1])


def test_split_set_missing_or_inconsistent(files, tmp_path):
    _, parts = files
    (tmp_path / parts[0].name).write_bytes(parts[0].read_bytes())
    (tmp_path / parts[2].name).write_bytes(parts[2].read_bytes())
    with pytest.raises(GGUFError, match="missing m-00002-of-00003.gguf"):
        GGUFModel(tmp_path / parts[0].name)
    (tmp_path / parts[1].name).write_bytes(parts[0].read_bytes())  # part 2 is a copy of part 1
    with pytest.raises(GGUFError, match="split.no/split.count say 0/3, expected part 1 of 3"):
        GGUFModel(tmp_path / parts[0].name)


def _metadata_only(path, arch: str, tensors: dict[str, tuple[np.ndarray, T]] | None = None):
    w = GGUFWriter(path, arch)
    w.add_block_count(1)
    _vocab(w, byte_level_vocab(320))
    for name, (data, qtype) in (tensors or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_names_it_and_lists_ours(tmp_path):
    g = GGUFModel(_metadata_only(tmp_path / "f.gguf", "falcon"))
    with pytest.raises(GGUFError, match=r"unsupported GGUF architecture 'falcon': pagemill serves llama \(Llama, "
                                        r"Mistral, Mixtral\); qwen2 .*gemma3 \(Gemma 3 \(text\)\)"):
        hf_config(g)


def test_unsupported_type_names_type_and_tensor(tmp_path):
    raw = np.zeros((4, 18), dtype=np.uint8)  # IQ4_NL: 32 values in 18 bytes
    path = _metadata_only(tmp_path / "t.gguf", "llama", {"blk.0.attn_q.weight": (raw, T.IQ4_NL)})
    with pytest.raises(GGUFError, match=r"GGUF tensor 'blk.0.attn_q.weight' has type IQ4_NL, which pagemill does not "
                                        r"read \(supported: F32, F16, BF16, Q4_0, .*Q6_K\)"):
        GGUFModel(path)


def test_unexpected_tensor_is_named(tmp_path):
    from pagemill.models.gguf.names import weight_plan

    path = _metadata_only(tmp_path / "u.gguf", "qwen2", {"blk.0.ssm_conv1d.weight": (np.zeros((4, 4), np.float32),
                                                                                       T.F32)})  # fmt: skip
    with pytest.raises(GGUFError, match="unexpected GGUF tensor 'blk.0.ssm_conv1d.weight' for architecture 'qwen2'"):
        weight_plan(GGUFModel(path), {"model_type": "qwen2"})


def test_truncated_file(tmp_path, files):
    single, _ = files
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(single.read_bytes()[: single.stat().st_size - 100])
    with pytest.raises(GGUFError, match="runs past the end of the file"):
        GGUFModel(cut)
