"""Constrained decoding (JSON schema, regex) on llguidance token masks."""

from pagemill.grammar.matcher import GrammarCompiler, GrammarError, GrammarMasker, GrammarState

__all__ = ["GrammarCompiler", "GrammarError", "GrammarMasker", "GrammarState"]
