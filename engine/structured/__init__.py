"""Constrained decoding: constraints compiled into llguidance grammars, and per-request masks.

Reading order: ``grammars`` (each ``ConstraintKind`` as a grammar), ``backend`` (compile once,
cache, time out; ``GrammarBackend.matcher`` per request), ``matcher`` (accept, roll back, fill a
mask, forced tokens for jump-forward, when the answer is finished), ``bitmask`` (allocate, fill
many rows in parallel, apply to logits), ``verify`` (speculative drafts against the grammar).
"""

from engine.structured.backend import CompiledGrammar, CompileStats, GrammarBackend
from engine.structured.bitmask import allocate_bitmask, apply_bitmask, fill_bitmasks
from engine.structured.matcher import GrammarMatcher
from engine.structured.verify import verify_drafts

__all__ = [
    "CompileStats",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarMatcher",
    "allocate_bitmask",
    "apply_bitmask",
    "fill_bitmasks",
    "verify_drafts",
]
