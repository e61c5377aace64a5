"""From the wire to the engine: a GenerateRequest proto becomes engine arguments, and engine
outputs become GenerateResponse protos."""

from __future__ import annotations

from engine.errors import InvalidRequestError
from engine.params import Constraint, ConstraintKind, SamplingParams
from engine.request import EngineRequest, FinishReason, RequestOutput, TokenLogprobs
from proto import splitserve_pb2 as pb

_FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def to_engine_request(request: pb.GenerateRequest, arrival_s: float, resume_token_ids=()) -> EngineRequest:
    """Raises InvalidRequestError naming the field when a value is out of range. ``arrival_s``:
    when the request reached the worker (``time.monotonic``); ``resume_token_ids``: the output
    a dead replica already streamed (a migrated request)."""
    sampling, stop = request.sampling, request.stop
    params = SamplingParams(
        max_tokens=stop.max_tokens if stop.HasField("max_tokens") else 16,
        temperature=sampling.temperature if sampling.HasField("temperature") else 1.0,
        top_p=sampling.top_p if sampling.HasField("top_p") else 1.0,
        top_k=sampling.top_k if sampling.HasField("top_k") else 0,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=tuple(stop.stop),
        stop_token_ids=tuple(stop.stop_token_ids),
        ignore_eos=stop.ignore_eos,
        presence_penalty=sampling.presence_penalty if sampling.HasField("presence_penalty") else 0.0,
        frequency_penalty=sampling.frequency_penalty if sampling.HasField("frequency_penalty") else 0.0,
        repetition_penalty=sampling.repetition_penalty if sampling.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted(sampling.logit_bias.items())),
        min_tokens=sampling.min_tokens if sampling.HasField("min_tokens") else 0,
        logprobs=sampling.logprobs if sampling.HasField("logprobs") else None,
        prompt_logprobs=sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else None,
        constraint=_constraint(sampling.constraint) if sampling.HasField("constraint") else None,
    )
    sources = [name for name, present in (
        ("prompt", request.HasField("prompt")),
        ("prompt_token_ids", len(request.prompt_token_ids) > 0),
        ("messages", len(request.messages) > 0),
    ) if present]
    if len(sources) > 1:
        raise InvalidRequestError(sources[0], f"give exactly one of prompt, prompt_token_ids and messages (got {', '.join(sources)})")
    if not sources:
        raise InvalidRequestError("prompt", "give one of prompt, prompt_token_ids and messages")
    prompt: str | list[int] | None = None
    messages = None
    if request.HasField("prompt"):
        prompt = request.prompt
    elif request.prompt_token_ids:
        prompt = list(request.prompt_token_ids)
    else:
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
    return EngineRequest(request.request_id, prompt, messages, params, request.tenant_salt or None, arrival_s, tuple(resume_token_ids))


def _constraint(constraint: pb.Constraint) -> Constraint | None:
    """The engine's Constraint of the proto's oneof (None when no kind is set, or ``json_object: false``)."""
    kind = constraint.WhichOneof("kind")
    if kind == "json_object" and not constraint.json_object:
        return None
    if kind == "json_schema":
        return Constraint(ConstraintKind.JSON_SCHEMA, spec=constraint.json_schema)
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT)
    if kind == "regex":
        return Constraint(ConstraintKind.REGEX, spec=constraint.regex)
    if kind == "choice":
        return Constraint(ConstraintKind.CHOICE, choices=tuple(constraint.choice.choices))
    if kind == "grammar":
        return Constraint(ConstraintKind.GRAMMAR, spec=constraint.grammar.source, syntax=constraint.grammar.syntax or "lark")
    return None


def _token_logprobs(values: tuple[TokenLogprobs, ...]) -> list[pb.TokenLogprobs]:
    return [
        pb.TokenLogprobs(token_id=v.token_id, logprob=v.logprob, top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in v.top])
        for v in values
    ]


def to_response(output: RequestOutput) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        request_id=output.request_id,
        text=output.text_delta,
        token_ids=output.new_token_ids,
        logprobs=_token_logprobs(output.logprobs),
        prompt_logprobs=_token_logprobs(output.prompt_logprobs),
    )
    if output.finished:
        response.finish_reason = _FINISH_REASONS[output.finish_reason]
        if output.stop_reason is not None:
            response.stop_reason = str(output.stop_reason)
        response.usage.prompt_tokens = output.num_prompt_tokens
        response.usage.completion_tokens = output.num_output_tokens
        response.usage.cached_prompt_tokens = output.num_cached_tokens
    return response
