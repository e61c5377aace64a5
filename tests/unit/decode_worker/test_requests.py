"""decode_worker/requests.py: the sampling fields of a GenerateRequest become engine parameters
(constraints included), bad values are refused naming the field, and log-probabilities reach the
GenerateResponse; the prefill worker's first-token parameters keep min_tokens' mask."""

import pytest

from decode_worker.actor import _first_token_logprobs, _first_token_params
from decode_worker.requests import to_engine_request, to_response
from engine.errors import InvalidRequestError
from engine.params import Constraint, ConstraintKind, SamplingParams
from engine.request import FinishReason, RequestOutput, TokenLogprobs
from kv_transfer.protocol import TransferResult, TransferStatus
from proto import splitserve_pb2 as pb


def _request(**sampling) -> pb.GenerateRequest:
    constraint = sampling.pop("constraint", None)
    request = pb.GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams(**sampling))
    if constraint is not None:
        request.sampling.constraint.CopyFrom(constraint)
    return request


def test_the_new_sampling_fields_reach_the_engine():
    request = _request(
        presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.25, logit_bias={7: 100.0, 3: -5.0},
        min_tokens=2, logprobs=4, prompt_logprobs=0, n=3,
    )
    params = to_engine_request(request, 0.0).params
    assert params == SamplingParams(
        presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.25, logit_bias=((3, -5.0), (7, 100.0)), min_tokens=2, logprobs=4, prompt_logprobs=0
    )


def test_unset_fields_keep_the_engines_defaults():
    assert to_engine_request(_request(), 0.0).params == SamplingParams()


@pytest.mark.parametrize(
    "constraint, expected",
    [
        (pb.Constraint(json_schema='{"type": "object"}'), Constraint(ConstraintKind.JSON_SCHEMA, spec='{"type": "object"}')),
        (pb.Constraint(json_object=True), Constraint(ConstraintKind.JSON_OBJECT)),
        (pb.Constraint(json_object=False), None),
        (pb.Constraint(regex="[a-z]+"), Constraint(ConstraintKind.REGEX, spec="[a-z]+")),
        (pb.Constraint(choice=pb.Choice(choices=["yes", "no"])), Constraint(ConstraintKind.CHOICE, choices=("yes", "no"))),
        (pb.Constraint(grammar=pb.Grammar(source="start: 'a'")), Constraint(ConstraintKind.GRAMMAR, spec="start: 'a'", syntax="lark")),
        (pb.Constraint(grammar=pb.Grammar(source="root ::= 'a'", syntax="ebnf")), Constraint(ConstraintKind.GRAMMAR, spec="root ::= 'a'", syntax="ebnf")),
        (pb.Constraint(), None),
    ],
)
def test_each_constraint_kind_becomes_the_engines_constraint(constraint, expected):
    assert to_engine_request(_request(constraint=constraint), 0.0).params.constraint == expected


@pytest.mark.parametrize(
    "sampling, field",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias={5: 101.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(min_tokens=17), "min_tokens"),
        (dict(logprobs=21), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(constraint=pb.Constraint(regex="")), "constraint.regex"),
        (dict(constraint=pb.Constraint(grammar=pb.Grammar(source="x", syntax="peg"))), "constraint.grammar.syntax"),
    ],
)
def test_bad_values_are_refused_naming_the_field(sampling, field):
    with pytest.raises(InvalidRequestError) as error:
        to_engine_request(_request(**sampling), 0.0)
    assert error.value.field == field


def test_logprobs_reach_the_response():
    first = TokenLogprobs(7, -0.25, ((7, -0.25), (9, -1.5)))
    prompt = (TokenLogprobs(2, -3.0), TokenLogprobs(3, -0.5, ((4, -0.1),)))
    output = RequestOutput("r", (7,), "x", True, FinishReason.LENGTH, None, 3, 0, 1, logprobs=(first,), prompt_logprobs=prompt)
    response = pb.GenerateResponse.FromString(to_response(output).SerializeToString())
    assert [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in response.logprobs] == [(7, -0.25, [(7, -0.25), (9, -1.5)])]
    assert [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in response.prompt_logprobs] == [(2, -3.0, []), (3, -0.5, [(4, pytest.approx(-0.1))])]
    assert not to_response(RequestOutput("r", (7,), "x", False, None, None, 3, 0, 1)).logprobs


def test_the_prefill_worker_samples_one_token_with_min_tokens_mask_and_logprobs():
    params = SamplingParams(max_tokens=8, min_tokens=5, stop=("x",), stop_token_ids=(4,), logprobs=2, prompt_logprobs=1, presence_penalty=1.0)
    first = _first_token_params(params)
    assert (first.max_tokens, first.min_tokens, first.stop, first.stop_token_ids, first.ignore_eos) == (1, 1, (), (4,), False)
    assert (first.logprobs, first.prompt_logprobs, first.presence_penalty) == (2, None, 1.0)
    assert _first_token_params(SamplingParams(max_tokens=8)).min_tokens == 0


def test_the_first_tokens_logprobs_cross_back_in_the_transfer_result():
    result = TransferResult("r", TransferStatus.DONE, first_token_id=7, first_token_logprob=-0.5, first_token_top_logprobs=((7, -0.5), (2, -1.0)))
    assert _first_token_logprobs(result) == TokenLogprobs(7, -0.5, ((7, -0.5), (2, -1.0)))
    assert _first_token_logprobs(TransferResult("r", TransferStatus.DONE, first_token_id=7)) is None


def test_min_tokens_holds_for_the_first_token_a_prefill_worker_samples(tiny_llama_dir):
    """EOS forced by logit bias: the prefill worker's engine samples it first only when the
    request allows it (min_tokens 0); with min_tokens the first token is something else."""
    from tests.unit.engine.helpers import make_engine

    llm = make_engine(tiny_llama_dir)
    to_eos = tuple((t, 100.0) for t in sorted(llm.eos_token_ids))
    firsts = {}
    for min_tokens in (0, 3):
        params = _first_token_params(SamplingParams(max_tokens=8, min_tokens=min_tokens, temperature=0, logit_bias=to_eos))
        llm.add_request(f"m{min_tokens}", [5, 6, 7], params, hold_kv=True)
        llm.run_to_completion([f"m{min_tokens}"])
        firsts[min_tokens] = llm.take_prefilled(f"m{min_tokens}").first_token
        llm.release_lease(f"m{min_tokens}")
    assert firsts[0] in llm.eos_token_ids and firsts[3] not in llm.eos_token_ids
