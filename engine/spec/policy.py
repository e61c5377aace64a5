"""How many drafts a sequence should verify next: per-request acceptance against a step-cost model.

A verify step of ``1 + k`` tokens costs more than a decode step of one: each more token in a
step costs ``token_cost`` decode steps of one sequence (on a CPU the weights are read once per
step, so it is small but not zero). With a per-draft acceptance rate ``a``, drafts are accepted
as a run that stops at the first rejection, so verifying k drafts yields on average
``E(k) = a + a^2 + ... + a^k`` extra tokens. In a step decoding ``B`` sequences, which costs
``S = 1 + token_cost * (B - 1)`` and yields B tokens, one sequence's drafts pay when they raise
the step's tokens per unit of cost::

    gain(k) = ((B + E(k)) / (S + token_cost * k + chunk_cost)) / (B / S)      (chunk_cost only if B > 1)

so the bar rises with the batch: a batch already amortises the weights over B tokens, and a
verify chunk leaves the batch's shared decode attention for an attention call of its own
(``chunk_cost``; alone, a sequence's chunk costs what its decode did).
The policy picks the k (up to what the proposer offered) with the best gain; when no k gains at
least ``min_gain``, the sequence stops proposing for ``backoff`` steps, then probes again with
one verify step of one draft: accepted, it raises the estimate enough to go on; rejected, the
sequence backs off again for twice as long (up to ``max_backoff``).
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_ACCEPTED = 1.0
PRIOR_TRIALS = 2.0
"""A new sequence starts believing half its drafts are accepted (weight of two observations)."""
DECAY = 0.8
"""Weight kept by past observations at each new verify step (acceptance drifts within a request)."""


@dataclass
class AcceptanceTracker:
    """One sequence's running acceptance estimate and its back-off state."""

    accepted: float = PRIOR_ACCEPTED
    trials: float = PRIOR_TRIALS
    skip_steps: int = 0
    """Steps left before drafts are proposed again."""
    backoff: int = 0
    """Length of the current back-off; 0 until the first one."""
    probing: bool = False
    """The back-off is over: the next offer is verified (one draft) whatever the estimate says."""

    @property
    def rate(self) -> float:
        """Estimated probability that the next draft is accepted, given the previous ones were."""
        return self.accepted / self.trials

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """A verify step accepted ``num_accepted`` of ``num_drafted`` drafts (a run from the first).

        Each accepted draft is a success; the first rejected one (if any) a failure: the
        maximum-likelihood estimate of a geometric run's per-draft rate, with decay.
        """
        rejected = 1 if num_accepted < num_drafted else 0
        self.accepted = DECAY * self.accepted + num_accepted
        self.trials = DECAY * self.trials + num_accepted + rejected


@dataclass(frozen=True)
class SpecPolicy:
    """Decides each step how many of the offered drafts a sequence verifies."""

    token_cost: float
    """Marginal cost of one more token in a step, in decode steps."""
    chunk_cost: float = 0.0
    """Cost of verifying one sequence in its own chunk beside a batch of decodes, in decode steps."""
    min_gain: float = 1.05
    """Expected tokens per unit of step cost below which speculating is not worth the risk."""
    first_backoff: int = 8
    max_backoff: int = 128

    def gain(self, rate: float, num_drafts: int, batch_size: int = 1) -> float:
        """Tokens per unit of step cost with ``num_drafts`` drafts verified, over those without."""
        expected = sum(rate**i for i in range(1, num_drafts + 1))
        plain_cost = 1 + self.token_cost * (batch_size - 1)
        spec_cost = plain_cost + self.token_cost * num_drafts + (self.chunk_cost if batch_size > 1 else 0.0)
        return (batch_size + expected) / spec_cost * plain_cost / batch_size

    def num_to_verify(self, tracker: AcceptanceTracker, num_offered: int, batch_size: int = 1) -> int:
        """How many of ``num_offered`` drafts to verify this step (0: decode plainly), in a step
        decoding ``batch_size`` sequences."""
        if tracker.skip_steps > 0:
            tracker.skip_steps -= 1
            return 0
        if num_offered == 0:
            return 0
        if tracker.probing:
            tracker.probing = False
            return 1
        best = max(range(1, num_offered + 1), key=lambda k: self.gain(tracker.rate, k, batch_size))
        if self.gain(tracker.rate, best, batch_size) >= self.min_gain:
            tracker.backoff = 0
            return best
        tracker.backoff = min(self.max_backoff, 2 * tracker.backoff) if tracker.backoff else self.first_backoff
        tracker.skip_steps = tracker.backoff
        tracker.probing = True
        return 0
