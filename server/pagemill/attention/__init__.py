"""Paged attention: metadata, backend interface, implementations."""

from pagemill.attention.backend import AttentionBackend, select_backend
from pagemill.attention.metadata import AttentionMetadata, make_metadata

__all__ = ["AttentionBackend", "AttentionMetadata", "make_metadata", "select_backend"]
