"""One constrained request's position in its grammar: which tokens may come next, and which must.

How the end works (llguidance's rules, which the engine follows):

- While the grammar is *accepting* (the text so far is a whole sentence) but could go on, the
  mask allows the EOS token(s) beside the tokens that continue it; sampling EOS ends the answer.
- Once the grammar is *finished* (a whole sentence that nothing can extend: a closed JSON
  object, the last character of a choice), the mask allows only EOS. The engine stops the
  request as soon as ``is_finished`` holds after accepting a token, with finish reason STOP,
  without spending a step on the EOS.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:  # only a tensor's own methods are called here: the module stays torch-free
    import torch


class GrammarMatcher:
    """Advances with each accepted token of one request and rolls back rejected drafts.

    Made by ``GrammarBackend.matcher``; used from one thread at a time (the engine thread, or the
    helper thread filling masks while the engine thread waits for the forward pass).
    """

    def __init__(self, ll_matcher: llguidance.LLMatcher, eos_token_ids: Collection[int], vocab_size: int, num_tokenizer_tokens: int) -> None:
        self._ll_matcher = ll_matcher
        self._eos_token_ids = frozenset(eos_token_ids)
        self.num_mask_words = (vocab_size + 31) // 32
        """Words of one bitmask row: ``ceil(vocab_size / 32)``."""
        self._num_tokenizer_tokens = num_tokenizer_tokens
        self.num_accepted_tokens = 0
        """Tokens accepted and not rolled back: the most ``rollback`` can undo."""
        self._num_eos_after_stop = 0

    @property
    def ll_matcher(self) -> llguidance.LLMatcher:
        """The llguidance matcher, for batched calls (``fill_bitmasks``); do not advance it directly."""
        return self._ll_matcher

    @property
    def is_finished(self) -> bool:
        """The answer is a whole sentence and nothing may follow but EOS: stop it (STOP)."""
        return self._ll_matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The answer so far is a whole sentence (EOS is allowed next)."""
        return self._ll_matcher.is_accepting()

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False, with the matcher unchanged, if the grammar refuses it."""
        if not 0 <= token_id < self._num_tokenizer_tokens:
            return False
        ll = self._ll_matcher
        if ll.is_stopped():
            # Once stopped, llguidance takes EOS without recording it (its rollback would undo
            # the token before), so EOS here is counted on this side only.
            if token_id not in self._eos_token_ids:
                return False
            self._num_eos_after_stop += 1
        elif ll.validate_tokens([token_id]) != 1:
            return False
        elif not ll.consume_token(token_id):
            raise AssertionError(f"llguidance refused token {token_id} it had validated: {ll.get_error()}")
        self.num_accepted_tokens += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (at most ``num_accepted_tokens``)."""
        if not 0 <= num_tokens <= self.num_accepted_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted_tokens} accepted")
        num_eos = min(num_tokens, self._num_eos_after_stop)
        num_ll_tokens = num_tokens - num_eos
        if num_ll_tokens and not self._ll_matcher.rollback(num_ll_tokens):
            raise AssertionError(f"llguidance could not roll back {num_ll_tokens} tokens: {self._ll_matcher.get_error()}")
        self._num_eos_after_stop -= num_eos
        self.num_accepted_tokens -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32, CPU, contiguous, one bit per
        token of the logits, as ``allocate_bitmask`` makes it). Drops the GIL while it computes."""
        check_bitmask(bitmask, self.num_mask_words)
        target = bitmask[row]
        self._ll_matcher.unsafe_compute_mask_ptr(target.data_ptr(), self.num_mask_words * 4)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, in order (empty where it leaves a choice, and once
        finished); not accepted yet: the engine appends them and ``accept``s each."""
        if self._ll_matcher.is_stopped():
            return []
        return self._ll_matcher.compute_ff_tokens()


def check_bitmask(bitmask: torch.Tensor, num_words: int) -> None:
    """ValueError unless ``bitmask`` is what llguidance may write into: int32, 2-D, on the CPU,
    contiguous, ``num_words`` words per row."""
    if str(bitmask.dtype) != "torch.int32" or bitmask.dim() != 2 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError(f"a bitmask is a contiguous 2-D int32 CPU tensor, got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")
    if bitmask.shape[1] != num_words:
        raise ValueError(f"a bitmask row has {num_words} words for this vocabulary, got {bitmask.shape[1]}")
