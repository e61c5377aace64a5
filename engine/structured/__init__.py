"""Constrained decoding: constraints compiled into llguidance grammars, and per-request masks.

Reading order: ``grammars`` (each ``ConstraintKind`` as a grammar), ``backend`` (compile once,
cache, time out; ``GrammarBackend.matcher`` per request), ``matcher`` (accept, roll back, fill a
mask, forced tokens for jump-forward, when the answer is finished), ``bitmask`` (allocate, fill
many rows in parallel, apply to logits), ``verify`` (speculative drafts against the grammar).

Import the modules themselves: this file imports nothing, and ``grammars``, ``backend`` and
``matcher`` import no torch, so ``engine.request`` can name ``GrammarMatcher`` while the worker
actor modules that import it stay torch-free (tests/unit/test_layering.py).
"""
