"""Speculative decoding: proposers (n-gram prompt lookup, draft model) and exact verification."""
