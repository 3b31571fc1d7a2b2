"""pagemill: an LLM text-generation server (Rust router, Python model shards)."""

__version__ = "0.1.0"
