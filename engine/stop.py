"""Stop strings over streamed text.

Text that could still turn out to be the start of a stop string is held back until it cannot,
so a client never sees half of a stop string that is later cut off.
"""

from __future__ import annotations


class StopStringMatcher:
    """Accumulates detokenized text deltas; emits text that is safe to show and finds stop strings."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.text = ""
        self.num_emitted_chars = 0
        self._max_stop_len = max((len(s) for s in stop), default=0)

    def add(self, delta: str) -> tuple[str, str | None]:
        """``(text safe to emit now, the stop string that matched or None)``."""
        search_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += delta
        if not self.stop:
            return self.flush(), None
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            index, matched = min(hits)
            self.text = self.text[:index]
            return self.flush(), matched
        safe_end = len(self.text) - self._held_back_chars()
        out = self.text[self.num_emitted_chars : safe_end]
        self.num_emitted_chars = max(self.num_emitted_chars, safe_end)
        return out, None

    def flush(self) -> str:
        """Everything not yet emitted (called when generation ends for another reason)."""
        out = self.text[self.num_emitted_chars :]
        self.num_emitted_chars = len(self.text)
        return out

    def _held_back_chars(self) -> int:
        for n in range(min(self._max_stop_len - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
