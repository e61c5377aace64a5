"""Expert-parallel engines give EP 1's tokens and transformers': real follower ranks as Ray actors,
joined to this process (the leader, rank 0) by real gloo process groups, each loading 1/N of the
experts of a tiny random MoE checkpoint (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE;
4 experts, top-2, 2 layers).

For each model at EP 2, and Mixtral at EP 4 too (one expert per rank), float32: greedy output
of a batch spread over every rank and of a single request (the other ranks idle, running empty
steps) equals EP 1 and transformers; seeded sampling equals EP 1; chunked prefill and preemption
change nothing; each rank holds exactly 1/N of EP 1's expert weight bytes; and every computed token
is routed to top_k experts in every layer, the same experts as at EP 1. Each follower rank is the
real TPFollower, in a Ray actor that hosts rank r of every engine the module builds, one after
another (tests/integration/parallel_engines.py).
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import UnsupportedModelError
from engine.layers.mlp import SparseMoE
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams
from engine.parallel.ranks import TPEngineBuilder
from engine.parallel.sharding import parameter_bytes
from tests.integration.parallel_engines import ParallelEngines, parallel_engines
from tests.unit.engine.helpers import GREEDY, random_prompts, transformers_greedy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODELS = ("mixtral", "qwen2-moe", "qwen3-moe")
CASES = [(m, 2) for m in MODELS] + [("mixtral", 4)]
"""(model, EP size): what changes with the model (a shared expert, normalised top-k weights) is
per rank, so one size of each shows it; one more size shows experts split one per rank."""
NUM_EXPERTS, TOP_K, NUM_LAYERS = 4, 2, 2
PROMPTS = random_prompts()  # 8 prompts of 1 to 100 tokens
SINGLE = PROMPTS[6]  # 70 tokens
SEEDED = SamplingParams(max_tokens=24, temperature=0.8, seed=1234, ignore_eos=True)
ROOMY = dict(kv_dtype="fp32", num_kv_blocks=64)
TIGHT = dict(kv_dtype="fp32", num_kv_blocks=10, max_num_batched_tokens=16)
"""Per rank: prompts of 17 to 100 tokens prefill in chunks of 16, and 10 blocks hold no rank's share of the batch."""
FOLLOWER_CPUS = 0.25


@pytest.fixture(scope="module")
def engines(follower_hosts):
    with parallel_engines(FOLLOWER_CPUS, "test-ep", follower_hosts) as e:
        yield e


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-ep{p[1]}")
def case(request, tiny_checkpoint) -> tuple[str, int]:
    """``(checkpoint dir, EP size)``; tests are grouped by it, so each EP engine is built once per config."""
    name, ep = request.param
    return str(tiny_checkpoint(name)), ep


_transformers: dict[str, list[tuple[int, ...]]] = {}


def transformers_tokens(model: str) -> list[tuple[int, ...]]:
    if model not in _transformers:
        _transformers[model] = transformers_greedy(model, PROMPTS, GREEDY.max_tokens)
    return _transformers[model]


def greedy_run(engine: LLMEngine, prompts, params=GREEDY) -> tuple[list[tuple[int, ...]], list[int]]:
    """Outputs of ``prompts`` submitted together on an empty prefix cache, and the DP ranks of the
    running requests after the first step (in admission order)."""
    engine.reset_prefix_cache()
    ids = [f"run-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    engine.step()
    ranks = [r.dp_rank for r in engine.scheduler.running]
    return [c.output_token_ids for c in engine.run_to_completion(ids)], ranks


def expert_tokens(engines: ParallelEngines, engine: LLMEngine) -> torch.Tensor:
    """``[layers, experts]``: tokens each expert has computed, over every rank (rank r holds the r-th run of experts)."""
    counts = [engine.runner.model.expert_tokens()] + [torch.tensor(info["expert_tokens"]) for info in engines.follower_infos()]
    return torch.cat(counts, dim=1)


def expert_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, SparseMoE) for p in (m.w13, m.w2))


def test_batch_spread_over_every_rank_matches_ep1_and_transformers(engines, case):
    model, ep = case
    expected = transformers_tokens(model)
    assert greedy_run(engines.get(EngineConfig(model=model, **ROOMY)), PROMPTS)[0] == expected

    got, ranks = greedy_run(engines.get(EngineConfig(model=model, ep_size=ep, **ROOMY)), PROMPTS)
    assert ranks == [i % ep for i in range(len(PROMPTS))]  # admitted in turn onto the least loaded rank
    assert got == expected
    assert all(len(tokens) == GREEDY.max_tokens for tokens in got)


def test_a_single_request_matches_while_the_other_ranks_run_empty_steps(engines, case):
    model, ep = case
    engine = engines.get(EngineConfig(model=model, ep_size=ep, **ROOMY))
    leader_steps, follower_steps = engine.runner.num_runs, [info["num_steps"] for info in engines.follower_infos()]

    got, ranks = greedy_run(engine, [SINGLE])
    assert ranks == [0]
    assert got == [transformers_tokens(model)[PROMPTS.index(SINGLE)]]
    steps = engine.runner.num_runs - leader_steps
    assert steps == GREEDY.max_tokens  # one prefill step, then one per decoded token but the last
    assert [info["num_steps"] - before for info, before in zip(engines.follower_infos(), follower_steps)] == [steps] * (ep - 1)


def test_seeded_sampling_matches_ep1(engines, case):
    model, ep = case
    expected = engines.get(EngineConfig(model=model, **ROOMY)).generate(PROMPTS, SEEDED)
    got = engines.get(EngineConfig(model=model, ep_size=ep, **ROOMY)).generate(PROMPTS, SEEDED)
    assert [c.output_token_ids for c in got] == [c.output_token_ids for c in expected]
    assert [c.output_token_ids for c in got] != transformers_tokens(model)  # it did sample


def test_each_rank_holds_one_nth_of_the_expert_weights(engines, case):
    model, ep = case
    ep1_model = engines.get(EngineConfig(model=model, **ROOMY)).runner.model
    ep1_expert_bytes = expert_bytes(ep1_model)
    assert ep1_expert_bytes % ep == 0 and ep1_expert_bytes > 0

    leader = engines.get(EngineConfig(model=model, ep_size=ep, **ROOMY)).runner.model
    for moe in (m for m in leader.modules() if isinstance(m, SparseMoE)):
        assert moe.experts_held == range(0, NUM_EXPERTS // ep)
        assert moe.w13.shape[0] == moe.w2.shape[0] == NUM_EXPERTS // ep
    replicated_bytes = parameter_bytes(leader) - expert_bytes(leader)
    assert replicated_bytes == parameter_bytes(ep1_model) - ep1_expert_bytes  # attention, router, shared expert, embeddings
    per_rank = [expert_bytes(leader)] + [info["param_bytes"] - replicated_bytes for info in engines.follower_infos()]
    assert per_rank == [ep1_expert_bytes // ep] * ep


def test_every_computed_token_is_routed_to_top_k_experts_in_every_layer_as_at_ep1(engines, case):
    model, ep = case
    computed = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (GREEDY.max_tokens - 1)  # the last sampled token is never fed
    counts = {}
    for size in (1, ep):
        engine = engines.get(EngineConfig(model=model, ep_size=size, **ROOMY))
        before, step_tokens = expert_tokens(engines, engine) if size > 1 else engine.runner.model.expert_tokens().clone(), engine.stats().num_step_tokens
        greedy_run(engine, PROMPTS)
        after = expert_tokens(engines, engine) if size > 1 else engine.runner.model.expert_tokens()
        counts[size] = after - before
        assert counts[size].shape == (NUM_LAYERS, NUM_EXPERTS)
        assert engine.stats().num_step_tokens - step_tokens == computed
        assert counts[size].sum(dim=1).tolist() == [computed * TOP_K] * NUM_LAYERS
    assert torch.equal(counts[ep], counts[1])


@pytest.mark.parametrize("name", MODELS)
def test_chunked_prefill_and_preemption_match_ep1_and_transformers(engines, tiny_checkpoint, name):
    """At EP 2 only: preemption and chunking are per DP rank, which two ranks already exercise; a
    tight engine group of four ranks cost the suite about 8 s per model for nothing more."""
    model, ep = str(tiny_checkpoint(name)), 2
    assert max(map(len, PROMPTS)) > 6 * TIGHT["max_num_batched_tokens"]
    expected = transformers_tokens(model)
    for size in (1, ep):
        engine = engines.get(EngineConfig(model=model, ep_size=size, **TIGHT))
        preemptions = engine.stats().num_preemptions
        assert greedy_run(engine, PROMPTS)[0] == expected
        assert engine.stats().num_preemptions > preemptions


@pytest.mark.parametrize(
    ("name", "ep", "message"),
    [
        ("llama", 2, "(LlamaForCausalLM) has no experts: expert parallelism needs a mixture-of-experts model; run it with ep_size 1"),
        ("mixtral", 3, "has 4 experts, which do not divide by expert parallel size 3. Sizes that work: 1, 2, 4"),
    ],
)
def test_a_replica_the_model_cannot_split_is_refused_with_a_sentence_and_joins_no_group(engines, tiny_checkpoint, name, ep, message):
    engines.close_parallel()
    config = EngineConfig(model=str(tiny_checkpoint(name)), ep_size=ep, **ROOMY)
    with pytest.raises(UnsupportedModelError) as refused:
        TPEngineBuilder(config, "test-ep-refused", num_cpus=FOLLOWER_CPUS, num_threads=1)
    assert str(refused.value).endswith(message)
    # No process group was joined: the next replica of this process joins one.
    mixtral = str(tiny_checkpoint("mixtral"))
    assert greedy_run(engines.get(EngineConfig(model=mixtral, ep_size=2, **ROOMY)), [SINGLE])[0] == [transformers_tokens(mixtral)[PROMPTS.index(SINGLE)]]
