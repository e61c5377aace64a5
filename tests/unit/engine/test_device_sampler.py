"""The device sampler: fixed shapes, counter-based draws, the CPU sampler's filters."""

import math

import torch

from engine.device_sampler import SamplingTensors, row_keys, sample_on_device, uniforms
from engine.params import SamplingParams

PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1])
LOGITS = torch.log(PROBS)[None, :]


def _draw(params: SamplingParams, n: int = 2000, seed: int = 0) -> list[int]:
    """Output positions 0 .. n-1 of one request, all in one batch of ``n`` rows."""
    tensors = SamplingTensors.of([params] * n, [seed] * n, list(range(n)), torch.device("cpu"))
    return sample_on_device(LOGITS.expand(n, -1).contiguous(), tensors).tolist()


def test_greedy_and_top_k_one_take_the_argmax_even_of_a_shifted_row():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    for params in (SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(temperature=1e-7)):
        assert sample_on_device(logits, SamplingTensors.of([params], [5], [0], torch.device("cpu"))).tolist() == [1]


def test_top_k_and_top_p_keep_the_cpu_samplers_support():
    assert set(_draw(SamplingParams(top_k=2))) == {0, 1}
    assert set(_draw(SamplingParams(top_p=0.5))) == {0, 1}  # 0.4 < 0.5 <= 0.4 + 0.3
    assert set(_draw(SamplingParams(top_p=0.75))) == {0, 1, 2}
    assert set(_draw(SamplingParams(top_p=1e-6), 50)) == {0}
    assert _draw(SamplingParams(top_k=1000), 300) == _draw(SamplingParams(top_k=0), 300)


def test_draws_follow_the_softmax_at_the_temperature():
    """4,000 draws per case: each frequency within 4 standard deviations of its probability."""
    n = 4000
    for temperature in (1.0, 0.5):
        expected = torch.softmax(torch.log(PROBS) / temperature, dim=0)
        counts = torch.bincount(torch.tensor(_draw(SamplingParams(temperature=temperature), n)), minlength=4)
        for p, count in zip(expected.tolist(), counts.tolist()):
            assert abs(count / n - p) <= 4 * math.sqrt(p * (1 - p) / n)


def test_a_row_draws_the_same_token_in_any_batch_and_padding():
    """Row (seed 7, position 3) alone, after other rows, and followed by greedy padding rows."""
    params = SamplingParams(temperature=1.0)
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(0))
    alone = sample_on_device(logits, SamplingTensors.of([params], [7], [3], torch.device("cpu")))
    others = torch.randn(5, 500, generator=torch.Generator().manual_seed(1))
    batch = torch.cat([others, logits])
    rows = SamplingTensors.of([params] * 6, [1, 2, 3, 4, 5, 7], [0, 0, 9, 9, 3, 3], torch.device("cpu"))
    assert sample_on_device(batch, rows)[5] == alone[0]
    static = SamplingTensors.empty(8, torch.device("cpu"))
    static.fill([params], [7], [3])
    padded = torch.cat([logits, torch.zeros(7, 500)])
    assert sample_on_device(padded, static)[0] == alone[0]


def test_positions_and_seeds_draw_unrelated_streams():
    draws = _draw(SamplingParams(temperature=1.0), 400)
    other_seed = _draw(SamplingParams(temperature=1.0), 400, seed=1)
    assert draws != other_seed
    assert len(set(draws)) == 4  # one seed's positions do not all draw alike


def test_fill_marks_rows_past_the_requests_greedy():
    static = SamplingTensors.of([SamplingParams(temperature=0.8)] * 4, [1] * 4, [0] * 4, torch.device("cpu"))
    static.fill([SamplingParams(temperature=0.5, top_k=3, top_p=0.9)], [2**64 - 1], [11])
    assert static.temperatures.tolist() == [0.5, 0.0, 0.0, 0.0]
    assert static.top_k[0] == 3 and math.isclose(static.top_p[0].item(), 0.9, rel_tol=1e-6) and static.positions[0] == 11
    assert static.seeds[0] == 2**63 - 1  # a seed beyond int64 keeps its low 63 bits


def test_the_hash_is_fixed_arithmetic():
    """Pinned keys and uniforms guard the arithmetic: a change here changes every seeded request's
    tokens on the device path (tests/gpu checks the GPU computes the same values)."""
    keys = row_keys(torch.tensor([0, 1, 2**40 + 3]), torch.tensor([0, 5, 7]))
    assert keys.tolist() == [3210455839, 966242607, 720976068]
    assert uniforms(keys[:1], 3).tolist() == [[0.34762516617774963, 0.22788605093955994, 0.8364821672439575]]
    u = uniforms(keys, 1000)
    assert bool(((u > 0) & (u < 1)).all())
    assert abs(u.mean().item() - 0.5) < 0.02
