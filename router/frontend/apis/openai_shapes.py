"""OpenAI answers from GenerateResponses: choices per sample, log-probabilities in each
endpoint's shape, and usage summed over the samples. Pure functions over protos and a tokenizer.

Log-probabilities, with each token's text from the model's tokenizer (``Tokenizer.token_text``;
a piece of a multi-byte character is U+FFFD there, and ``bytes`` holds its real bytes)::

    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
    completions  {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}

(``TokenStrings``: token_texts.py). A completions ``top_logprobs`` entry holds the alternatives and the sampled token (as vLLM's),
keyed by text: two ids with the same text keep the likelier.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from proto import splitserve_pb2 as pb
from router.frontend.apis.token_texts import TokenStrings

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


def chat_logprobs(entries: Iterable[pb.TokenLogprobs], strings: TokenStrings) -> list[dict]:
    """Chat's ``logprobs.content`` items."""

    def item(token_id: int, logprob: float) -> dict:
        text, raw = strings(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t.token_id, t.logprob) for t in e.top]} for e in entries]


def completion_logprobs(entries: Sequence[pb.TokenLogprobs], strings: TokenStrings, text_offset: int) -> dict:
    """Completions' ``logprobs`` object; offsets count characters from ``text_offset``."""
    tokens, offsets, tops = [], [], []
    for e in entries:
        text = strings(e.token_id)[0]
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        top: dict[str, float] = {}
        for t in (*e.top, e):
            t_text = strings(t.token_id)[0]
            top[t_text] = max(top.get(t_text, t.logprob), t.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops, "text_offset": offsets}


def usage_body(usages: Sequence[pb.Usage]) -> dict:
    """Usage of every sample: the prompt once (the first sample's), completion tokens summed."""
    first = usages[0] if usages else pb.Usage()
    completion = sum(u.completion_tokens for u in usages)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_prompt_tokens},
    }


@dataclass
class Sample:
    """One choice's answer, as its responses arrive."""

    index: int
    texts: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    usage: pb.Usage | None = None

    def add(self, response: pb.GenerateResponse) -> None:
        self.texts.append(response.text)
        self.logprobs.extend(response.logprobs)
        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = FINISH_REASONS.get(response.finish_reason)
            self.usage = response.usage

    @property
    def text(self) -> str:
        return "".join(self.texts)


def collect(responses: Iterable[pb.GenerateResponse], num_choices: int) -> list[Sample]:
    """The n answers of interleaved responses, by index."""
    samples = [Sample(i) for i in range(num_choices)]
    for response in responses:
        samples[response.index].add(response)
    return samples


def summed_usage(samples: Sequence[Sample]) -> dict:
    return usage_body([s.usage for s in sorted(samples, key=lambda s: s.index) if s.usage is not None])
