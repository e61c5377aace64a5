"""The router's checks of a resumed answer (router.frontend.validation): what it refuses, by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from proto import splitserve_pb2 as pb
from router.client import build_generate_request
from router.config import RouterConfig
from router.errors import CallRejected
from router.frontend.validation import ResumeTagger, check_resume, resume_key

KEY = resume_key(RouterConfig(port=0))
VOCAB = 100


def tagged(request: pb.GenerateRequest, token_ids: list[int], key: bytes = KEY) -> pb.GenerateRequest:
    """``request`` resuming after ``token_ids``, with the tag its first router sent."""
    tagger = ResumeTagger(key, request)
    for t in token_ids:  # one response per token, as a router tags them
        tagger.add([t])
    resumed = pb.GenerateRequest()
    resumed.CopyFrom(request)
    resumed.resume.token_ids.extend(token_ids)
    resumed.resume.tag = tagger.tag()
    return resumed


def check(request: pb.GenerateRequest, key: bytes = KEY) -> None:
    forwarded = pb.GenerateRequest()
    forwarded.CopyFrom(request)
    forwarded.ClearField("resume")
    check_resume(request, request.resume, VOCAB, ResumeTagger(key, forwarded))


def refusal(request: pb.GenerateRequest, key: bytes = KEY) -> str:
    with pytest.raises(CallRejected) as e:
        check(request, key)
    return e.value.message


GREEDY = build_generate_request("hi", max_tokens=8, temperature=0)
SEEDED = build_generate_request("hi", max_tokens=8, temperature=0.7, seed=5)


def test_a_resume_with_the_tokens_and_tag_its_router_sent_is_taken():
    check(tagged(GREEDY, [1, 2, 3]))
    check(tagged(SEEDED, [4, 5]))
    with_id = tagged(SEEDED, [4, 5])
    with_id.request_id = "assigned-by-the-first-router"  # the id is no part of what the tag binds
    check(with_id)


def test_tags_chain_over_responses_whatever_their_sizes():
    one_by_one = ResumeTagger(KEY, GREEDY)
    for t in (1, 2, 3):
        one_by_one.add([t])
    at_once = ResumeTagger(KEY, GREEDY)
    at_once.add([1, 2])
    at_once.add([3])
    assert one_by_one.tag() == at_once.tag()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.resume.token_ids.__setitem__(1, 7), "resume.tag: does not match the request and its 3 token ids"),
        (lambda r: r.resume.token_ids.pop(), "resume.tag: does not match the request and its 2 token ids"),
        (lambda r: setattr(r, "prompt", "ho"), "resume.tag: does not match"),
        (lambda r: setattr(r.sampling, "seed", 6), "resume.tag: does not match"),
        (lambda r: setattr(r.stop, "max_tokens", 9), "resume.tag: does not match"),
        (lambda r: r.ClearField("resume") or r.resume.token_ids.extend([1, 2, 3]), "resume.tag: missing"),
        (lambda r: r.resume.token_ids.__setitem__(0, VOCAB), f"resume.token_ids: [0] = {VOCAB} is outside the vocabulary of {VOCAB} tokens"),
        (lambda r: r.resume.token_ids.extend(range(5)), "resume.token_ids: 8 tokens already reach max_tokens 8: that answer was complete"),
        (lambda r: r.sampling.ClearField("seed"), "sampling.seed: a sampled answer resumes only with its seed"),
    ],
    ids=["altered-token", "dropped-token", "other-prompt", "other-seed", "other-max-tokens", "no-tag", "outside-vocab", "past-max-tokens", "sampled-without-seed"],
)
def test_a_resume_the_router_cannot_verify_is_refused_by_name(change, message):
    request = tagged(SEEDED, [1, 2, 3])
    change(request)
    assert refusal(request).startswith(message)


def test_a_tag_made_with_another_clusters_key_is_refused():
    other = RouterConfig(port=0)
    assert resume_key(other) == KEY  # without cluster TLS every router shares the public key
    assert refusal(tagged(GREEDY, [1, 2]), key=b"another cluster's key").startswith("resume.tag: does not match")


def test_with_cluster_tls_the_key_comes_from_the_cluster_private_key(tmp_path):
    """Every router holds the cluster's private key and no client does: tags then prove origin."""
    key_file = tmp_path / "cluster.key"
    key_file.write_bytes(b"-----BEGIN PRIVATE KEY-----\nthe cluster's key\n")
    config = RouterConfig(port=0)
    object.__setattr__(config, "cluster_tls", SimpleNamespace(key_file=key_file))  # a real ClusterTLSConfig needs certificates
    key = resume_key(config)
    assert key != KEY and len(key) == 32
    check(tagged(GREEDY, [1, 2], key), key)
    assert refusal(tagged(GREEDY, [1, 2], KEY), key).startswith("resume.tag: does not match")
