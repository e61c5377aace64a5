"""A GrammarBackend over the real SmolLM2 tokenizer, one per test module."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.structured.backend import GrammarBackend
from engine.tokenizer import Tokenizer

VOCAB_SIZE = 49152
"""SmolLM2's logits width (config.json's vocab_size)."""


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> GrammarBackend:
    return GrammarBackend(tokenizer, VOCAB_SIZE)
