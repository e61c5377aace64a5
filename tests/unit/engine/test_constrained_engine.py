"""Constrained decoding end to end in the engine, with the bundled SmolLM2: every sampled answer
obeys its constraint, jump-forward appends forced tokens whose KV is right, speculative drafts are
checked against the grammar, and a bad constraint is refused by name."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.params import Constraint, ConstraintKind, SamplingParams
from engine.request import EngineRequest

NUM_ANSWERS = 20
"""Seeded answers per constraint (one batch): of the any-JSON-object answers, 15 end and 5 are cut
at max_tokens, so both of that test's branches are checked (50 took 2.5 times as long)."""
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"
CHOICES = ("positive", "negative", "neutral")
ARITHMETIC = """
start: NUMBER (OP NUMBER)? (OP NUMBER)? (OP NUMBER)?
OP: "+" | "-" | "*"
NUMBER: /[1-9][0-9]{0,2}/
"""
ARITHMETIC_EBNF = r"""
root ::= num (op num){0,3}
num ::= [1-9] [0-9]?
op ::= "+" | "-"
"""


def _json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict)


def _person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


CASES = {
    "json_object": (Constraint(ConstraintKind.JSON_OBJECT), "Describe a city as a JSON object.", _json_object),
    "json_schema": (Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(PERSON)), "Give a person as JSON.", _person),
    "regex": (Constraint(ConstraintKind.REGEX, EMAIL), "Write an email address.", lambda t: re.fullmatch(EMAIL, t) or pytest.fail(t)),
    "choice": (Constraint(ConstraintKind.CHOICE, choices=CHOICES), "Is 'I love it' positive?", lambda t: t in CHOICES or pytest.fail(t)),
    "grammar_lark": (Constraint(ConstraintKind.GRAMMAR, ARITHMETIC), "Write a sum.", lambda t: re.fullmatch(r"[1-9][0-9]{0,2}([-+*][1-9][0-9]{0,2}){0,3}", t) or pytest.fail(t)),
    "grammar_ebnf": (Constraint(ConstraintKind.GRAMMAR, ARITHMETIC_EBNF, syntax="ebnf"), "Write a sum.", lambda t: re.fullmatch(r"[1-9][0-9]?([-+][1-9][0-9]?){0,3}", t) or pytest.fail(t)),
}


@pytest.fixture(scope="module")
def engine(smollm2_cache_dir):
    """fp32 KV: a cached prefix then gives the tokens a fresh prefill gives (FP8 blocks would not, bit for bit)."""
    engine = LLMEngine(EngineConfig(model="smollm2-135m", kv_dtype="fp32", max_num_seqs=NUM_ANSWERS, kv_cache_bytes=256 << 20, cache_dir=smollm2_cache_dir))
    yield engine
    engine.close()


def _prompt(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.chat_prompt_ids([{"role": "user", "content": text}], engine.model_name)


@pytest.mark.slow
@pytest.mark.parametrize("kind", [k for k in CASES if k != "json_object"])
def test_every_seeded_sampled_answer_obeys_its_constraint(engine, kind):
    """Constraints whose sentences are bounded: every answer ends (STOP) and obeys."""
    constraint, question, check = CASES[kind]
    params = [SamplingParams(max_tokens=96, temperature=1.0, seed=seed, constraint=constraint) for seed in range(NUM_ANSWERS)]
    answers = engine.generate([_prompt(engine, question)] * NUM_ANSWERS, params)
    for answer in answers:
        assert answer.finish_reason.value == "stop", (answer.text, answer.finish_reason)
        check(answer.text)
    assert len({a.text for a in answers}) > 1  # sampled, not one forced answer


@pytest.mark.slow
def test_any_json_object_answers_parse_when_they_end_and_are_json_prefixes_when_cut(engine):
    """Any JSON object is unbounded: SmolLM2-135M at temperature 1 ends about two thirds of its
    objects within 128 tokens and repeats keys in the rest until max_tokens. Every answer that
    ends parses; every cut one is a prefix the grammar still accepts."""
    constraint, question, check = CASES["json_object"]
    params = [SamplingParams(max_tokens=128, temperature=1.0, seed=seed, constraint=constraint) for seed in range(NUM_ANSWERS)]
    answers = engine.generate([_prompt(engine, question)] * NUM_ANSWERS, params)
    ended = [a for a in answers if a.finish_reason.value == "stop"]
    for answer in ended:
        check(answer.text)
    for answer in answers:
        matcher = engine.grammars.matcher(constraint)
        assert all(matcher.accept(t) for t in answer.output_token_ids)
        assert matcher.is_finished == (answer.finish_reason.value == "stop")
    assert len(ended) >= NUM_ANSWERS // 2


def test_jump_forward_appends_forced_tokens_whose_kv_a_recompute_agrees_with(engine):
    """The schema forces `{"name": "` and `", "age": ` ...: those tokens come out with the token
    sampled before them, without a step each. Resumed after any step's output (its KV all
    recomputed, under another tenant so no cached block is shared), the answer goes on with the
    same greedy tokens: the forced tokens' KV, computed with the next sampled token, was right."""
    constraint = CASES["json_schema"][0]
    prompt = _prompt(engine, "Give a person as JSON.")
    params = SamplingParams(max_tokens=96, temperature=0, constraint=constraint)
    before = engine.stats()
    engine.add_request("jump", prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        steps += [o.new_token_ids for o in engine.step() if o.new_token_ids]
    after = engine.stats()
    output = [t for step in steps for t in step]
    _person(engine.tokenizer.decode(output))
    num_forced = after.num_forced_tokens - before.num_forced_tokens
    assert num_forced >= 3
    assert len(steps) == len(output) - num_forced  # one step per sampled token: forced ones ride along
    assert max(len(step) for step in steps) > 1
    boundaries = [sum(len(step) for step in steps[:i]) for i in range(1, len(steps))]
    for cut in (boundaries[0], boundaries[len(boundaries) // 2], boundaries[-1]):
        engine.add_request(f"resumed-{cut}", prompt, params, tenant_salt="recompute", resume_token_ids=output[:cut])
        [resumed] = engine.run_to_completion([f"resumed-{cut}"])
        assert list(resumed.output_token_ids) == output, cut


def test_speculative_drafts_are_checked_against_the_grammar(smollm2_cache_dir, engine):
    """n-gram drafts the grammar refuses are never kept: a speculating engine gives the plain
    engine's greedy constrained answers."""
    spec = LLMEngine(EngineConfig(model="smollm2-135m", kv_dtype="fp32", speculative="ngram", kv_cache_bytes=128 << 20, cache_dir=smollm2_cache_dir))
    try:
        for kind in ("json_schema", "grammar_lark"):
            constraint, question, check = CASES[kind]
            params = SamplingParams(max_tokens=64, temperature=0, constraint=constraint)
            prompt = _prompt(engine, question)
            engine.add_request(f"plain-{kind}", prompt, params, tenant_salt=f"fresh-{kind}")  # a fresh prefill in both engines
            [plain] = engine.run_to_completion([f"plain-{kind}"])
            [drafted] = spec.generate([prompt], params)
            check(drafted.text)
            assert drafted.output_token_ids == plain.output_token_ids
        assert spec.stats().num_draft_tokens > 0
    finally:
        spec.close()


@pytest.mark.parametrize(
    ("constraint", "field", "reason"),
    [
        (Constraint(ConstraintKind.JSON_SCHEMA, "{not json"), "constraint.json_schema", ""),
        (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "strin"}'), "constraint.json_schema", "strin"),
        (Constraint(ConstraintKind.REGEX, "(unclosed"), "constraint.regex", ""),
        (Constraint(ConstraintKind.GRAMMAR, "start: undefined_rule"), "constraint.grammar", "undefined_rule"),
    ],
)
def test_a_bad_constraint_is_refused_naming_the_field_and_the_reason(engine, constraint, field, reason):
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("bad", [1, 2, 3], SamplingParams(constraint=constraint))
    assert e.value.field == field and reason in str(e.value)
    assert "bad" not in engine._requests


def test_the_engine_loop_compiles_off_the_engine_thread_and_refuses_before_any_output(smollm2_cache_dir):
    config = EngineConfig(model="smollm2-135m", kv_cache_bytes=32 << 20, cache_dir=smollm2_cache_dir)
    loop = EngineLoop(lambda: LLMEngine(config), max_waiting_requests=4, num_threads=1)
    loop.start()

    async def run(constraint):
        request = EngineRequest("r", [1, 2, 3], None, SamplingParams(max_tokens=8, temperature=0, constraint=constraint), None)
        return [o async for o in loop.generate(request)]

    try:
        outputs = asyncio.run(run(Constraint(ConstraintKind.CHOICE, choices=("yes", "no"))))
        assert "".join(o.text_delta for o in outputs) in ("yes", "no")
        with pytest.raises(InvalidRequestError) as e:
            asyncio.run(run(Constraint(ConstraintKind.REGEX, "[z-a]")))
        assert e.value.field == "constraint.regex"
    finally:
        loop.stop()
