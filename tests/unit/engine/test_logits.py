"""engine/logits.py on random logits: every processing step batched equals a per-row reference
loop, rows without a feature are untouched, the bitmask's bit layout, and log-probabilities."""

from collections import Counter

import pytest
import torch

from engine.logits import SampleRow, apply_bitmask, process_logits, sample_rows, sampled_logprobs, token_logprobs
from engine.params import SamplingParams
from engine.request import Request, TokenLogprobs

VOCAB = 300
EOS = frozenset({2})


def _row(params: SamplingParams, prompt=(), output=(), position=None, banned=EOS) -> SampleRow:
    return SampleRow(params, 0, len(output) if position is None else position, list(prompt), tuple(output), banned)


def _reference(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """One row, one token at a time, in float32 as the batched pass computes."""
    out = logits.clone()
    p = row.params
    for token, bias in p.logit_bias:
        out[token] += torch.tensor(bias, dtype=torch.float32)
    if row.position < p.min_tokens:
        for token in row.min_tokens_banned:
            out[token] = float("-inf")
    if p.repetition_penalty != 1:
        penalty = torch.tensor(p.repetition_penalty, dtype=torch.float32)
        for token in set(row.prompt_token_ids) | set(row.output_token_ids):
            out[token] = out[token] / penalty if out[token] > 0 else out[token] * penalty
    counts = Counter(row.output_token_ids)
    if p.presence_penalty or p.frequency_penalty:
        for token, count in counts.items():
            out[token] -= torch.tensor(p.frequency_penalty, dtype=torch.float32) * count + torch.tensor(p.presence_penalty, dtype=torch.float32)
    return out


def _ids(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def test_every_step_batched_equals_a_per_row_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, VOCAB, generator=g) * 4
    rows = [
        _row(SamplingParams(logit_bias=((5, 100.0), (7, -100.0), (299, 2.5)))),
        _row(SamplingParams(min_tokens=3, stop_token_ids=(9, 11)), output=_ids(g, 2), banned=EOS | {9, 11}),
        _row(SamplingParams(repetition_penalty=1.7), prompt=_ids(g, 40), output=_ids(g, 10)),
        _row(SamplingParams(presence_penalty=0.5), output=_ids(g, 30)),
        _row(SamplingParams(frequency_penalty=-1.25), output=_ids(g, 50) * 2),
        _row(SamplingParams()),  # untouched
        _row(
            SamplingParams(max_tokens=20, logit_bias=((3, 1.0),), min_tokens=4, repetition_penalty=0.6, presence_penalty=-2, frequency_penalty=2),
            prompt=_ids(g, 17),
            output=_ids(g, 3),
        ),
        _row(SamplingParams(min_tokens=3), output=_ids(g, 3)),  # past min_tokens: untouched
    ]
    expected = torch.stack([_reference(logits[i], row) for i, row in enumerate(rows)])
    got = process_logits(logits.clone(), rows)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert torch.equal(got[5], logits[5]) and torch.equal(got[7], logits[7])
    assert got[1, 2] == got[1, 9] == got[1, 11] == float("-inf")
    assert got[6, 2] == float("-inf") and got[7, 2] == logits[7, 2]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_tokens():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0]])
    [got] = process_logits(logits.clone(), [_row(SamplingParams(repetition_penalty=2.0), prompt=[0, 1])])
    assert got.tolist() == [1.0, -4.0, 3.0, -1.0]


def test_a_step_without_processing_is_left_as_it_is():
    logits = torch.randn(3, VOCAB)
    rows = [_row(SamplingParams(temperature=0.5, logprobs=3)), _row(SamplingParams(min_tokens=1), position=1), _row(SamplingParams())]
    assert not any(r.processes_logits for r in rows)
    assert torch.equal(process_logits(logits.clone(), rows), logits)


@pytest.mark.parametrize("vocab", [32, 45, 300])
def test_apply_bitmask_allows_bit_j_of_word_w_as_token_32w_plus_j(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=g)
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[2, 0] = -1  # sign bit set: token 31 allowed
    got = logits.clone()
    apply_bitmask(got, bitmask, [0, 2])
    for row in range(3):
        for token in range(vocab):
            allowed = row == 1 or (int(bitmask[row, token // 32]) >> (token % 32)) & 1
            assert got[row, token] == (logits[row, token] if allowed else float("-inf"))


def test_process_logits_applies_the_bitmask_hook_to_its_rows_only():
    calls = []
    logits = torch.zeros(2, 64)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    process_logits(logits, [_row(SamplingParams()), _row(SamplingParams())], bitmask, [1], apply=lambda *a: calls.append(a))
    assert len(calls) == 1 and calls[0][2] == [1]


def test_token_logprobs_are_log_softmax_at_the_temperature_with_the_top_sorted():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, VOCAB, generator=g)
    tokens = [int(logits[0].argmax()), 17, 5]
    got = token_logprobs(logits, tokens, [1.0, 0.5, 2.0], [4, 0, 20])
    for i, (value, temperature) in enumerate(zip(got, [1.0, 0.5, 2.0])):
        reference = torch.log_softmax(logits[i] / temperature, dim=-1)
        assert value.token_id == tokens[i] and value.logprob == reference[tokens[i]].item()
        top_values, top_ids = reference.topk([4, 0, 20][i])
        assert value.top == tuple(zip(top_ids.tolist(), top_values.tolist()))
        assert [lp for _, lp in value.top] == sorted((lp for _, lp in value.top), reverse=True)
    assert got[0].top[0] == (tokens[0], got[0].logprob)


def test_sampled_logprobs_only_for_rows_that_ask_and_greedy_rows_at_temperature_one():
    logits = torch.randn(3, VOCAB)
    rows = [_row(SamplingParams(temperature=0, logprobs=2)), _row(SamplingParams()), _row(SamplingParams(temperature=0.7, logprobs=0))]
    got = sampled_logprobs(logits, rows, [1, 2, 3])
    assert got[1] is None and got[2].top == ()
    assert got[0].logprob == torch.log_softmax(logits[0], dim=-1)[1].item()
    assert got[2].logprob == torch.log_softmax(logits[2] / 0.7, dim=-1)[3].item()


def test_prompt_logprobs_recorded_once_across_recomputed_chunks():
    request = Request("r", [5, 6, 7, 8], SamplingParams(prompt_logprobs=1), 0, EOS, 64, None, 0)
    first = [TokenLogprobs(6, -1.0), TokenLogprobs(7, -2.0)]
    request.add_prompt_logprobs(1, first)
    assert request.owes_prompt_logprobs
    request.add_prompt_logprobs(1, [TokenLogprobs(6, -9.0), TokenLogprobs(7, -9.0), TokenLogprobs(8, -3.0)])  # recomputed after a preemption
    assert request.prompt_logprobs == first + [TokenLogprobs(8, -3.0)] and not request.owes_prompt_logprobs
    with pytest.raises(ValueError):
        Request("s", [5, 6, 7], SamplingParams(prompt_logprobs=1), 0, EOS, 64, None, 0).add_prompt_logprobs(2, first)


def test_sample_rows_of_a_verify_chunk_count_earlier_drafts_as_output():
    params = SamplingParams(max_tokens=10, min_tokens=5, presence_penalty=1.0)
    request = Request("r", [5, 6], params, 0, EOS, 64, None, 0)
    request.token_ids += [8, 9]
    rows = sample_rows([(request, (20, 21, 22))])
    assert [(r.position, r.output_token_ids) for r in rows] == [(2, (8, 9)), (3, (8, 9, 20)), (4, (8, 9, 20, 21)), (5, (8, 9, 20, 21, 22))]
    assert all(r.min_tokens_banned == EOS for r in rows) and [r.processes_logits for r in rows] == [True] * 4
    plain = sample_rows([(Request("p", [5], SamplingParams(), 0, EOS, 64, None, 0), ())])
    assert plain[0].output_token_ids == () and not plain[0].processes_logits
