"""Compiling constraints into grammars once, and handing each request a fresh matcher.

    request ──compile(constraint)──▶ LRU cache ──hit──▶ CompiledGrammar ──matcher()──▶ GrammarMatcher
                                        │ miss
                                        ▼
                          compile thread (daemon): build the grammar, build a template
                          matcher, compute its first mask; the caller waits at most
                          compile_timeout_s, llguidance's own fuel limits end the thread
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field

import llguidance

from engine.errors import InvalidRequestError
from engine.params import Constraint
from engine.structured.grammars import grammar_from_constraint
from engine.structured.matcher import GrammarMatcher
from engine.tokenizer import Tokenizer

CacheKey = tuple[str, str, tuple[str, ...], str]


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint checked and compiled, shared by every request that carries it."""

    constraint: Constraint
    grammar: str
    """The llguidance grammar (JSON text, or Lark)."""
    compile_s: float
    """Wall seconds the compile took."""
    template: llguidance.LLMatcher = field(repr=False)
    """A matcher in the start state with its first mask computed; only ever copied."""


@dataclass(frozen=True)
class CompileStats:
    """Counters since the backend was made, for the bench and the metrics."""

    num_compiles: int
    """Compiles started (cache misses)."""
    num_cache_hits: int
    """``compile`` calls that found the constraint cached, compiled or still compiling."""
    num_compile_errors: int
    """Compiles that refused the constraint (timeouts not counted)."""
    num_compile_timeouts: int
    """``compile`` calls that gave up waiting."""
    compile_s_total: float
    """Wall seconds of the compiles that have finished."""


class GrammarBackend:
    """Compiles constraints with llguidance for one tokenizer and makes per-request matchers.

    ``vocab_size`` is the width of the model's logits: masks have one bit per logit, and ids the
    tokenizer does not have (``vocab_size`` may exceed it) are never allowed. Thread-safe: the
    worker compiles from a pool while the engine thread makes matchers from the cache.
    ``grammar_builder`` turns a constraint into llguidance grammar text (a seam for tests).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        compile_timeout_s: float = 10.0,
        cache_size: int = 256,
        grammar_builder: Callable[[Constraint], str] = grammar_from_constraint,
    ) -> None:
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {tokenizer.vocab_size} tokens")
        if not compile_timeout_s > 0 or cache_size < 1:
            raise ValueError(f"compile_timeout_s must be > 0 and cache_size >= 1, got {compile_timeout_s}, {cache_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids = tokenizer.eos_token_ids
        self._num_tokenizer_tokens = tokenizer.vocab_size
        self._ll_tokenizer = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=sorted(self.eos_token_ids))
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._compile_timeout_s = compile_timeout_s
        self._cache_size = cache_size
        self._grammar_builder = grammar_builder
        self._cache: collections.OrderedDict[CacheKey, Future[CompiledGrammar]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._num_compiles = self._num_cache_hits = self._num_compile_errors = self._num_compile_timeouts = 0
        self._compile_s_total = 0.0

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar of ``constraint``, from the cache or compiled now.

        ``InvalidRequestError`` naming ``constraint.field`` with llguidance's reason when the
        schema, regex or grammar is invalid (cached like a success, so a repeat fails at once),
        or when it does not compile within ``compile_timeout_s`` (the compile goes on in its
        thread and a later request for the same constraint waits for it again).
        """
        key = (constraint.kind.value, constraint.spec, constraint.choices, constraint.syntax)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self._num_cache_hits += 1
            else:
                future = self._cache[key] = Future()
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
                self._num_compiles += 1
                threading.Thread(target=self._compile_into, args=(constraint, future), name="grammar-compile", daemon=True).start()
        try:
            return future.result(timeout=self._compile_timeout_s)
        except FutureTimeoutError:
            with self._lock:
                self._num_compile_timeouts += 1
            raise InvalidRequestError(constraint.field, f"did not compile within {self._compile_timeout_s:g} s") from None

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher for one request, at the start of the grammar (``compile``'s errors)."""
        return self.new_matcher(self.compile(constraint))

    def new_matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher for one request of an already compiled grammar."""
        return GrammarMatcher(compiled.template.deep_copy(), self.eos_token_ids, self.vocab_size, self._num_tokenizer_tokens)

    def stats(self) -> CompileStats:
        with self._lock:
            return CompileStats(self._num_compiles, self._num_cache_hits, self._num_compile_errors, self._num_compile_timeouts, self._compile_s_total)

    def _compile_into(self, constraint: Constraint, future: Future[CompiledGrammar]) -> None:
        start_s = time.perf_counter()
        try:
            compiled = self._compile_now(constraint, start_s)
        except Exception as e:  # handed to the waiting caller, who raises it
            with self._lock:
                self._num_compile_errors += isinstance(e, InvalidRequestError)
                self._compile_s_total += time.perf_counter() - start_s
            future.set_exception(e)
            return
        with self._lock:
            self._compile_s_total += compiled.compile_s
        future.set_result(compiled)

    def _compile_now(self, constraint: Constraint, start_s: float) -> CompiledGrammar:
        grammar = self._grammar_builder(constraint)
        # Building the matcher checks the grammar (and drops the GIL while it does); computing the
        # first mask builds the lexer states a first step needs, and surfaces limits hit there.
        template = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0, limits=self._limits)
        if not template.is_error():
            template.compute_bitmask()
        if template.is_error():
            raise InvalidRequestError(constraint.field, template.get_error().strip())
        return CompiledGrammar(constraint, grammar, time.perf_counter() - start_s, template)


