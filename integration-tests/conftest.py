import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# The SDK of this tree (scripts/test.sh also pip-installs it).
sys.path.insert(0, str(Path(__file__).parent.parent / "clients" / "python"))

from server import launch  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--snapshot-update", action="store_true", default=False,
                     help="rewrite integration-tests/snapshots/*.json from the server's answers "
                          "(or set PAGEMILL_SNAPSHOT_UPDATE=1)")


@pytest.fixture(scope="session")
def snapshot_update(request) -> bool:
    import os

    return request.config.getoption("--snapshot-update") or os.environ.get("PAGEMILL_SNAPSHOT_UPDATE") == "1"


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from pagemill.models.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def server(default_model_dir):
    """One server on the default model for the tests that only talk to it."""
    s = launch(str(default_model_dir), "--max-batch-prefill-tokens", "2048", "--max-input-tokens", "1024",
               "--max-total-tokens", "2048", "--kv-cache-memory", "512MiB", "--max-concurrent-requests", "64")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def hf_model(default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    model.eval()
    return tok, model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A random-weight tiny Llama (GQA) with the default model's tokenizer: starts in seconds."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, out / name)
    return out
