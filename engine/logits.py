"""What happens to a step's logits between the model and the sampler, and the log-probabilities
read from them, batched over the sampled rows.

``process_logits`` changes the rows that ask for it, in this order: logit bias, min_tokens
masking (EOS and stop tokens to -inf), repetition penalty (prompt and output), presence and
frequency penalties (output), then a constraint's allowed-token bitmask. Each is a few tensor ops
over the rows that use it (counts per row are one ``scatter_add`` of a padded id tensor); rows
that use none are not touched, and a step with no such row costs one Python pass over its rows.
The sampler then draws from the processed logits, and ``token_logprobs`` reads the
log-probabilities from the same ones, ``log_softmax(logits / T)`` (T = 1 for a greedy row): so a
token's reported log-probability is that of the distribution it was drawn from (before top-k and
top-p, as vLLM and OpenAI report it). ``record_prompt_logprobs`` reads prompt tokens' from the
logits of the prompt positions a step computed (``StepPlan.prompt_rows``).

A constraint's bitmask enters through ``ModelRunner.execute(chunks, bitmasks)``: per constrained
request ``int32 [1 + drafts, ceil(vocab / 32)]``, stacked by ``stack_bitmasks`` and applied by
``apply_bitmask`` (or the ``apply`` hook of ``process_logits``, e.g. a backend's own kernel).

Rows of a verify chunk (speculative decoding: the sequence's last token and k drafts, 1 + k rows)
count the drafts before them as output: row j is output token n + j, following drafts 0..j-1::

    output so far: o0 .. o(n-1)     drafts: d0 d1 d2
    row 0: output o0 .. o(n-1)               position n
    row 1: output o0 .. o(n-1) d0            position n + 1
    row 3: output o0 .. o(n-1) d0 d1 d2      position n + 3
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from engine.params import SamplingParams
from engine.request import Request, TokenLogprobs
from engine.structured.bitmask import apply_bitmask

BitmaskHook = Callable[[torch.Tensor, torch.Tensor, Sequence[int]], None]
"""``apply_bitmask(logits, bitmask, rows)``: set to -inf, in place, the tokens the bitmask bans in ``rows``."""


@dataclass(frozen=True)
class SampleRow:
    """One sampled logits row: whose it is and what its processing reads."""

    params: SamplingParams
    seed: int
    position: int
    """Output tokens before this row's: its seed's counter, and what min_tokens compares."""
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    """The output before this row's token (drafts before it included); empty when no penalty reads it."""
    min_tokens_banned: frozenset[int]
    """Masked while ``position < params.min_tokens``: the stop token ids, and EOS unless ignore_eos."""

    @property
    def processes_logits(self) -> bool:
        """Whether ``process_logits`` changes this row (a constraint's bitmask aside)."""
        p = self.params
        return bool(
            p.logit_bias or self.position < p.min_tokens or p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty
        )

    @property
    def temperature(self) -> float:
        """The temperature its log-probabilities are read at (1 for a greedy row)."""
        return 1.0 if self.params.is_greedy else self.params.temperature


def sample_rows(requests: Sequence[tuple[Request, tuple[int, ...]]]) -> list[SampleRow]:
    """The rows that ``requests`` sample, in order: one per request, or ``1 + len(drafts)`` for a
    verify chunk (row j after drafts 0..j-1)."""
    rows = []
    for request, drafts in requests:
        p = request.params
        reads_output = p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty
        output = tuple(request.output_token_ids) if reads_output else ()
        banned = frozenset()
        if p.min_tokens > request.num_output_tokens:
            banned = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else request.eos_token_ids)
        for j in range(len(drafts) + 1):
            rows.append(
                SampleRow(p, request.seed, request.num_output_tokens + j, request.prompt_token_ids, output + drafts[:j] if reads_output else (), banned)
            )
    return rows


def stack_bitmasks(
    requests: Sequence[tuple[Request, tuple[int, ...]]], bitmasks: Mapping[Request, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor | None, list[int]]:
    """One ``int32 [rows, words]`` bitmask for the step's sampled rows from each constrained
    request's own (``[1 + drafts, words]``), and the rows it applies to (the others' rows are all
    ones, never applied). None when no request has one."""
    if not bitmasks:
        return None, []
    words = next(iter(bitmasks.values())).shape[-1]
    num_rows = sum(len(drafts) + 1 for _, drafts in requests)
    stacked = torch.full((num_rows, words), -1, dtype=torch.int32, device=device)
    rows, row = [], 0
    for request, drafts in requests:
        own = bitmasks.get(request)
        if own is not None:
            stacked[row : row + len(drafts) + 1] = own.view(-1, words)[: len(drafts) + 1].to(device)
            rows += range(row, row + len(drafts) + 1)
        row += len(drafts) + 1
    return stacked, rows


def process_logits(
    logits: torch.Tensor,
    rows: Sequence[SampleRow],
    bitmask: torch.Tensor | None = None,
    bitmask_rows: Sequence[int] = (),
    apply: BitmaskHook = apply_bitmask,
) -> torch.Tensor:
    """``logits [len(rows), vocab]`` (float32) after each row's processing, changed in place.

    ``bitmask`` (``int32 [len(rows), ceil(vocab / 32)]``) applies to ``bitmask_rows`` through
    ``apply`` (``apply_bitmask`` by default; a constraint backend may pass its own kernel)."""
    changed = [i for i, row in enumerate(rows) if row.processes_logits]
    if changed:
        index = torch.tensor(changed, dtype=torch.long, device=logits.device)
        logits[index] = _processed([rows[i] for i in changed], logits[index])
    if bitmask is not None and bitmask_rows:
        apply(logits, bitmask, bitmask_rows)
    return logits


def _processed(rows: list[SampleRow], logits: torch.Tensor) -> torch.Tensor:
    """The four steps on ``logits`` (a copy of the changed rows, one per entry of ``rows``)."""
    vocab, device = logits.shape[-1], logits.device
    biased = [(i, t, b) for i, row in enumerate(rows) for t, b in row.params.logit_bias if t < vocab]
    if biased:
        at, token, bias = zip(*biased)
        logits.index_put_((_long(at, device), _long(token, device)), torch.tensor(bias, dtype=logits.dtype, device=device), accumulate=True)
    banned = [(i, t) for i, row in enumerate(rows) if row.position < row.params.min_tokens for t in row.min_tokens_banned if t < vocab]
    if banned:
        at, token = zip(*banned)
        logits[_long(at, device), _long(token, device)] = float("-inf")
    repeated = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1]
    if repeated:
        seen = _counts([list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids) for i in repeated], vocab, device) > 0
        penalty = torch.tensor([rows[i].params.repetition_penalty for i in repeated], dtype=logits.dtype, device=device)[:, None]
        part = logits[_long(repeated, device)]
        scaled = torch.where(part > 0, part / penalty, part * penalty)
        logits[_long(repeated, device)] = torch.where(seen, scaled, part)
    penalized = [i for i, row in enumerate(rows) if row.params.presence_penalty or row.params.frequency_penalty]
    if penalized:
        counts = _counts([rows[i].output_token_ids for i in penalized], vocab, device).to(logits.dtype)
        presence = torch.tensor([rows[i].params.presence_penalty for i in penalized], dtype=logits.dtype, device=device)[:, None]
        frequency = torch.tensor([rows[i].params.frequency_penalty for i in penalized], dtype=logits.dtype, device=device)[:, None]
        logits[_long(penalized, device)] -= frequency * counts + presence * (counts > 0).to(logits.dtype)
    return logits


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _counts(id_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``int32 [len(id_lists), vocab]``: how often each token is in each list (ids past the
    vocabulary ignored). One scatter_add of the lists padded with ``vocab`` (a column dropped after)."""
    width = max(1, max(len(ids) for ids in id_lists))
    padded = torch.full((len(id_lists), width), vocab, dtype=torch.long)
    for i, ids in enumerate(id_lists):
        if ids:
            padded[i, : len(ids)] = torch.tensor(ids, dtype=torch.long).clamp_(max=vocab)
    counts = torch.zeros((len(id_lists), vocab + 1), dtype=torch.int32, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones_like(padded, dtype=torch.int32, device=device))
    return counts[:, :vocab]


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], temperatures: Sequence[float], num_top: Sequence[int]) -> list[TokenLogprobs]:
    """For each row of ``logits`` (float32 ``[n, vocab]``): ``token_ids[i]``'s log-probability
    under ``log_softmax(logits[i] / temperatures[i])`` and the ``num_top[i]`` most likely tokens
    there, most likely first. One log_softmax and one topk (of the largest ``num_top``) for all rows."""
    if not len(token_ids):
        return []
    device = logits.device
    scaled = logits / torch.tensor(temperatures, dtype=logits.dtype, device=device)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    chosen = logprobs.gather(1, _long(token_ids, device)[:, None]).squeeze(1).tolist()
    width = min(max(num_top), logits.shape[-1])
    top_values, top_ids = [[]] * len(token_ids), [[]] * len(token_ids)
    if width:
        values, ids = logprobs.topk(width, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    return [
        TokenLogprobs(int(token), value, tuple(zip(top_ids[i][: num_top[i]], top_values[i][: num_top[i]])))
        for i, (token, value) in enumerate(zip(token_ids, chosen))
    ]


def sampled_logprobs(logits: torch.Tensor, rows: Sequence[SampleRow], tokens: Sequence[int]) -> list[TokenLogprobs | None]:
    """Each row's ``TokenLogprobs`` of its sampled token where its request asks (``params.logprobs``), else None."""
    asking = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(rows)
    if not asking:
        return out
    index = _long(asking, logits.device)
    found = token_logprobs(logits[index], [tokens[i] for i in asking], [rows[i].temperature for i in asking], [rows[i].params.logprobs for i in asking])
    for i, value in zip(asking, found):
        out[i] = value
    return out


@dataclass(frozen=True)
class PromptSpan:
    """Prompt positions ``[start, start + num_positions)`` of ``request`` computed this step whose
    logits give the log-probabilities of prompt tokens ``start + 1, ...`` (not recorded yet)."""

    request: Request
    start: int
    num_positions: int


def prompt_span(request: Request, chunk_start: int, num_new_tokens: int) -> PromptSpan | None:
    """The positions of a chunk ``[chunk_start, chunk_start + num_new_tokens)`` whose prompt
    log-probabilities ``request`` still owes (the prompt's last position samples instead)."""
    if not request.owes_prompt_logprobs:
        return None
    start = max(chunk_start, len(request.prompt_logprobs))
    end = min(chunk_start + num_new_tokens, request.num_prompt_tokens - 1)
    return PromptSpan(request, start, end - start) if end > start else None


def record_prompt_logprobs(logits: torch.Tensor | None, spans: Sequence[PromptSpan]) -> None:
    """Give each span's request its prompt tokens' ``TokenLogprobs`` from ``logits`` (one row per
    position, the spans' rows in order), read at the request's temperature as sampled rows are
    (the model's own distribution: no penalty, bias or mask applies to a token it did not sample)."""
    if not spans:
        return
    next_ids, temperatures, num_top = [], [], []
    for span in spans:
        p = span.request.params
        next_ids += span.request.prompt_token_ids[span.start + 1 : span.start + 1 + span.num_positions]
        temperatures += [1.0 if p.is_greedy else p.temperature] * span.num_positions
        num_top += [p.prompt_logprobs] * span.num_positions
    found = token_logprobs(logits, next_ids, temperatures, num_top)
    row = 0
    for span in spans:
        span.request.add_prompt_logprobs(span.start + 1, found[row : row + span.num_positions])
        row += span.num_positions
