"""The speculator: asks a proposer for drafts, lets the policy trim them, counts what was accepted.

The scheduler calls ``propose`` at the start of each step with the running sequences that are
decoding (their whole sequence computed but the last token); each gets ``draft_token_ids``,
which the scheduler verifies as one chunk of ``1 + k`` tokens. After the step, ``observe`` hears
how many were accepted. Drafts are deterministic (copied tokens, or the draft model's argmax),
so the draft distribution q is one-hot; see ``verify.accepted_prefix`` for why the target's own
sample decides acceptance.
"""

from __future__ import annotations

from typing import Protocol

from engine.request import Request
from engine.spec.ngram import propose_ngram
from engine.spec.policy import AcceptanceTracker, SpecPolicy


class Proposer(Protocol):
    """Where drafts come from: the sequence itself (n-gram) or a draft model."""

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        """Up to ``num_drafts[i]`` tokens guessed to follow ``requests[i].token_ids`` (each >= 1)."""
        ...

    def forget(self, request: Request) -> None:
        """``request`` has finished: drop whatever state the proposer keeps for it."""
        ...


class NgramProposer:
    """Prompt lookup: drafts copied from what followed the sequence's tail earlier in it."""

    def __init__(self, min_match: int, max_match: int) -> None:
        self.min_match = min_match
        self.max_match = max_match

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        return [propose_ngram(r.token_ids, k, self.min_match, self.max_match) for r, k in zip(requests, num_drafts)]

    def forget(self, request: Request) -> None:
        pass


class Speculator:
    """Per-step drafting for the running batch, with per-request acceptance tracking."""

    def __init__(self, proposer: Proposer, policy: SpecPolicy, max_drafts: int) -> None:
        self.proposer = proposer
        self.policy = policy
        self.max_drafts = max_drafts
        self._trackers: dict[Request, AcceptanceTracker] = {}
        self.num_draft_tokens = 0
        """Draft tokens verified (proposed and sent through the target model)."""
        self.num_accepted_tokens = 0
        """Draft tokens the target model accepted."""

    def propose(self, requests: list[Request]) -> None:
        """Set ``draft_token_ids`` of each of ``requests`` (decoding sequences); () where drafting
        does not pay or the request has no room left for more than one token."""
        wanted, asking = [], []
        for request in requests:
            request.draft_token_ids = ()
            tracker = self._trackers.setdefault(request, AcceptanceTracker())
            k = self.policy.num_to_verify(tracker, min(self.max_drafts, _room(request)), len(requests))
            if k > 0:
                wanted.append(k)
                asking.append(request)
        if not asking:
            return
        for request, drafts in zip(asking, self.proposer.propose(asking, wanted)):
            request.draft_token_ids = tuple(drafts)

    def observe(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """The verify step of ``request`` accepted ``num_accepted`` of its ``num_drafted`` drafts."""
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        tracker = self._trackers.get(request)
        if tracker is not None:
            tracker.observe(num_drafted, num_accepted)

    def forget(self, request: Request) -> None:
        """``request`` finished or was aborted."""
        self._trackers.pop(request, None)
        self.proposer.forget(request)


def _room(request: Request) -> int:
    """Most drafts whose acceptance (plus the one token a verify step always adds) stays within
    the request's max_tokens and the model's context."""
    by_tokens = request.params.max_tokens - request.num_output_tokens - 1
    by_context = request.max_model_len - request.num_tokens - 1
    return max(0, min(by_tokens, by_context))
