"""Checks the router makes before a request reaches a worker (the engine checks the rest), and
the tags that let another router verify a resumed answer.

A resume tag binds a request to the output streamed for it so far::

    digest_n = SHA-256(version, len(R), R, t_0 .. t_n-1)    R: the request as forwarded (its
    tag_n    = HMAC-SHA256(key, digest_n)                      seed filled in, no request_id or
                                                               resume), t_i: uint32 little-endian

Each response carries the tag of every token id streamed up to it; a client that resumes sends
the last one back with those ids, and the router taking over recomputes it. The key is derived
from the cluster's private key when cluster TLS is on (every router holds it, no client does), so
a tag then proves the tokens came from this cluster; without it the key is public and a tag only
proves they belong to this request, unaltered (a caller forging tokens gains nothing it could not
get by sending them in prompt_token_ids).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from pathlib import Path

from proto import splitserve_pb2 as pb
from router.config import RouterConfig
from router.errors import invalid, quoted

GREEDY_BELOW_TEMPERATURE = 1e-5
"""engine.params.GREEDY_BELOW_TEMPERATURE (the router does not import the engine)."""
DEFAULT_MAX_TOKENS = 16
"""The engine's max_tokens when a request sets none."""
MAX_LOGPROBS = 20
"""engine.params.MAX_LOGPROBS: the most top alternatives per token (OpenAI's cap)."""
_MASK64 = (1 << 64) - 1
_TAG_VERSION = b"splitserve-resume-v1"
_PUBLIC_KEY = hashlib.sha256(_TAG_VERSION + b" public key").digest()


def check_generate(request: pb.GenerateRequest, config: RouterConfig, served_models: list[str]) -> None:
    """Raise CallRejected(INVALID_ARGUMENT) naming the field for a malformed request."""
    check_model(request.model, served_models)
    sources = [n for n, present in (
        ("prompt", request.HasField("prompt")),
        ("prompt_token_ids", len(request.prompt_token_ids) > 0),
        ("messages", len(request.messages) > 0),
    ) if present]
    if len(sources) > 1:
        raise invalid(sources[0], f"give exactly one of prompt, prompt_token_ids and messages (got {', '.join(sources)})")
    if not sources:
        raise invalid("prompt", "give one of prompt, prompt_token_ids and messages")
    check_prompt_size(request.prompt, request.messages, config)
    if len(request.prompt_token_ids) > config.max_prompt_token_ids:
        raise invalid("prompt_token_ids", f"{len(request.prompt_token_ids)} ids exceed the limit of {config.max_prompt_token_ids}")
    for i, message in enumerate(request.messages):
        if not message.role:
            raise invalid(f"messages[{i}].role", "must not be empty")
    if len(request.request_id) > 256:
        raise invalid("request_id", "longer than 256 characters")
    check_sampling(request, config)


def check_sampling(request: pb.GenerateRequest, config: RouterConfig) -> None:
    """What the router itself needs right (n fans out here); the engine checks the ranges of the rest."""
    sampling = request.sampling
    if sampling.HasField("n"):
        if not 1 <= sampling.n <= config.max_n:
            raise invalid("sampling.n", f"must be in [1, {config.max_n}] (the router's --max-n), got {sampling.n}")
        if sampling.n > 1 and request.resume.token_ids:
            raise invalid("resume", "an answer of n > 1 samples resumes sample by sample: send each as n = 1 with the seed and resume_tag its responses carried")
    for name in ("logprobs", "prompt_logprobs"):
        if sampling.HasField(name) and not 0 <= getattr(sampling, name) <= MAX_LOGPROBS:
            raise invalid(f"sampling.{name}", f"must be in [0, {MAX_LOGPROBS}], got {getattr(sampling, name)}")
    if request.tools_json:
        try:
            tools = json.loads(request.tools_json)
        except ValueError as e:
            raise invalid("tools_json", f"is not JSON: {e}") from None
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise invalid("tools_json", "must be a JSON array of tool objects")


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of an answer of n samples seeded with ``seed`` (sample 0
    keeps it): splitmix64 of the pair, so the samples draw unrelated streams, and a client that
    knows the seed it sent knows every sample's."""
    if index == 0:
        return seed
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def check_model(model: str, served_models: list[str]) -> None:
    """A named model must be served by a live decode replica; with none live (all being
    replaced) nothing is known to refuse, and the caller answers UNAVAILABLE instead."""
    if model and served_models and model not in served_models:
        raise invalid("model", f"{quoted(model)} is not served here (served: {', '.join(served_models) or 'none'})")


def check_prompt_size(prompt: str, messages, config: RouterConfig) -> None:
    """A chat message's role counts with its content: the chat template renders both."""
    num_chars = len(prompt) + sum(len(m.role) + len(m.content) for m in messages)
    if num_chars > config.max_prompt_chars:
        field = "prompt" if prompt else "messages"
        raise invalid(field, f"{num_chars} characters exceed the limit of {config.max_prompt_chars}")


def resume_key(config: RouterConfig) -> bytes:
    """The key of this router's resume tags; every router of a cluster derives the same one."""
    if config.cluster_tls is None:
        return _PUBLIC_KEY
    return hmac.new(Path(config.cluster_tls.key_file).read_bytes(), _TAG_VERSION, hashlib.sha256).digest()


def is_greedy(sampling: pb.SamplingParams) -> bool:
    """Whether the engine picks the most likely token (no seed needed to repeat the answer)."""
    return (sampling.HasField("temperature") and sampling.temperature < GREEDY_BELOW_TEMPERATURE) or sampling.top_k == 1


class ResumeTagger:
    """The resume tags of one answer, kept as its tokens stream (one hash update per response)."""

    def __init__(self, key: bytes, request: pb.GenerateRequest) -> None:
        """``request``: as forwarded to the workers, its seed set, before tokenization."""
        fingerprint = pb.GenerateRequest()
        fingerprint.CopyFrom(request)
        fingerprint.ClearField("request_id")
        fingerprint.ClearField("resume")
        data = fingerprint.SerializeToString(deterministic=True)
        self._key = key
        self._digest = hashlib.sha256(_TAG_VERSION + struct.pack("<Q", len(data)) + data)

    def add(self, token_ids) -> None:
        if token_ids:
            self._digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))

    def tag(self) -> bytes:
        """The tag of every token id added so far."""
        return hmac.new(self._key, self._digest.copy().digest(), hashlib.sha256).digest()


def check_resume(request: pb.GenerateRequest, resume: pb.Resume, vocab_size: int, tagger: ResumeTagger) -> None:
    """Refuse by name a resume (of ``request``, as forwarded) this router cannot verify;
    ``tagger`` has not seen its tokens yet and has them added (it goes on tagging the answer from
    there). ``vocab_size``: the largest vocabulary a live decode replica of the model has (0:
    none known, not checked)."""
    token_ids = resume.token_ids
    max_tokens = request.stop.max_tokens if request.stop.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if len(token_ids) >= max_tokens:
        raise invalid("resume.token_ids", f"{len(token_ids)} tokens already reach max_tokens {max_tokens}: that answer was complete")
    if vocab_size:
        for i, token_id in enumerate(token_ids):
            if token_id >= vocab_size:
                raise invalid("resume.token_ids", f"[{i}] = {token_id} is outside the vocabulary of {vocab_size} tokens")
    if not is_greedy(request.sampling) and not request.sampling.HasField("seed"):
        raise invalid("sampling.seed", "a sampled answer resumes only with its seed: set the seed its first response reported")
    if not resume.tag:
        raise invalid("resume.tag", "missing: send the resume_tag of the last response received with its token ids")
    tagger.add(token_ids)
    if not hmac.compare_digest(tagger.tag(), resume.tag):
        raise invalid("resume.tag", f"does not match the request and its {len(token_ids)} token ids (a token, the request or its seed differs from the answer that was cut, or another cluster tagged it)")
