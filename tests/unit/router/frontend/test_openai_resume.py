"""The OpenAI API's resume extension: ``resume`` and ``return_resume`` in a body, and what a
streamed chunk carries for a resume."""

import base64

import pytest

from proto import splitserve_pb2 as pb
from router.frontend.apis.errors import APIError
from router.frontend.apis.openai_api import resume_body
from router.frontend.apis.openai_schema import parse_chat, parse_completion

MODELS = {"m": pb.ModelInfo(id="m", max_model_len=512)}
TAG = bytes(range(32))


def test_a_resume_in_a_body_becomes_the_requests_resume():
    parsed = parse_completion({"model": "m", "prompt": "hi", "seed": 4, "stream": True, "return_resume": True,
                               "resume": {"token_ids": [5, 6], "tag": base64.b64encode(TAG).decode()}}, MODELS)
    assert parsed.return_resume
    assert (list(parsed.generate.resume.token_ids), parsed.generate.resume.tag, parsed.generate.sampling.seed) == ([5, 6], TAG, 4)
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, MODELS)
    assert not chat.return_resume and not chat.generate.HasField("resume")


@pytest.mark.parametrize(
    ("resume", "param", "message"),
    [
        ([1, 2], "resume", "resume: must be an object with token_ids and tag, got list"),
        ({"token_ids": [1, -2], "tag": ""}, "resume.token_ids", "resume.token_ids: must be a list of token ids"),
        ({"token_ids": [1]}, "resume.tag", "resume.tag: required: the tag of the last chunk received"),
        ({"token_ids": [1], "tag": "not base64!"}, "resume.tag", "resume.tag: not base64"),
    ],
)
def test_a_malformed_resume_is_400_naming_the_field(resume, param, message):
    with pytest.raises(APIError) as e:
        parse_completion({"model": "m", "prompt": "hi", "resume": resume}, MODELS)
    assert (e.value.status, e.value.param) == (400, param)
    assert e.value.message.startswith(message)


def test_a_chunk_carries_its_token_ids_the_tag_and_on_the_first_the_seed():
    first = pb.GenerateResponse(token_ids=[7, 8], resume_tag=TAG, seed=99)
    later = pb.GenerateResponse(token_ids=[9], resume_tag=TAG)
    assert resume_body(first) == {"token_ids": [7, 8], "tag": base64.b64encode(TAG).decode(), "seed": 99}
    assert resume_body(later) == {"token_ids": [9], "tag": base64.b64encode(TAG).decode()}
