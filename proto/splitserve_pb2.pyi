# DO NOT EDIT: generated from proto/splitserve.proto by grpcio-tools 1.85.1 (python -m proto.generate).
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "logprobs", "prompt_logprobs", "n", "constraint")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    logprobs: int
    prompt_logprobs: int
    n: int
    constraint: Constraint
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., n: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choice
    grammar: Grammar
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choice, _Mapping]] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("source", "syntax")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SYNTAX_FIELD_NUMBER: _ClassVar[int]
    source: str
    syntax: str
    def __init__(self, source: _Optional[str] = ..., syntax: _Optional[str] = ...) -> None: ...

class StopConditions(_message.Message):
    __slots__ = ("max_tokens", "stop", "stop_token_ids", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "prompt_token_ids", "messages", "sampling", "stop", "request_id", "tenant_salt", "resume", "tools_json")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling: SamplingParams
    stop: StopConditions
    request_id: str
    tenant_salt: str
    resume: Resume
    tools_json: str
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Union[StopConditions, _Mapping]] = ..., request_id: _Optional[str] = ..., tenant_salt: _Optional[str] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., tools_json: _Optional[str] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("token_ids", "tag")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tag: bytes
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tag: _Optional[bytes] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("worker_first_token_s", "worker_total_s", "queue_s", "kv_handoff_s", "admitted_s", "first_step_end_s", "request_plane_s", "prefill_steps", "prefill_step_tokens")
    WORKER_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    WORKER_TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFF_S_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_END_S_FIELD_NUMBER: _ClassVar[int]
    REQUEST_PLANE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_first_token_s: float
    worker_total_s: float
    queue_s: float
    kv_handoff_s: float
    admitted_s: float
    first_step_end_s: float
    request_plane_s: float
    prefill_steps: int
    prefill_step_tokens: int
    def __init__(self, worker_first_token_s: _Optional[float] = ..., worker_total_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., kv_handoff_s: _Optional[float] = ..., admitted_s: _Optional[float] = ..., first_step_end_s: _Optional[float] = ..., request_plane_s: _Optional[float] = ..., prefill_steps: _Optional[int] = ..., prefill_step_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "stop_reason", "usage", "timings", "seed", "resume_tag", "logprobs", "prompt_logprobs", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RESUME_TAG_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stop_reason: str
    usage: Usage
    timings: Timings
    seed: int
    resume_tag: bytes
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    index: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., seed: _Optional[int] = ..., resume_tag: _Optional[bytes] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "prompt", "messages", "add_special_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_special_tokens: bool
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "max_model_len", "vocab_size", "kv_dtype", "block_size")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    vocab_size: int
    kv_dtype: str
    block_size: int
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., block_size: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class GetClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("replica_id", "pool", "model", "healthy", "num_running", "num_waiting", "num_kv_blocks", "num_free_kv_blocks", "metrics_url", "num_aborted_requests", "num_queued_prefill_tokens", "tp_size", "tp_ranks", "ep_size", "ep_load_max_over_mean", "hottest_experts", "draining", "pp_size")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANKS_FIELD_NUMBER: _ClassVar[int]
    EP_SIZE_FIELD_NUMBER: _ClassVar[int]
    EP_LOAD_MAX_OVER_MEAN_FIELD_NUMBER: _ClassVar[int]
    HOTTEST_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    pool: str
    model: str
    healthy: bool
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    metrics_url: str
    num_aborted_requests: int
    num_queued_prefill_tokens: int
    tp_size: int
    tp_ranks: _containers.RepeatedCompositeFieldContainer[TPRank]
    ep_size: int
    ep_load_max_over_mean: float
    hottest_experts: _containers.RepeatedCompositeFieldContainer[ExpertLoad]
    draining: bool
    pp_size: int
    def __init__(self, replica_id: _Optional[str] = ..., pool: _Optional[str] = ..., model: _Optional[str] = ..., healthy: _Optional[bool] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., num_free_kv_blocks: _Optional[int] = ..., metrics_url: _Optional[str] = ..., num_aborted_requests: _Optional[int] = ..., num_queued_prefill_tokens: _Optional[int] = ..., tp_size: _Optional[int] = ..., tp_ranks: _Optional[_Iterable[_Union[TPRank, _Mapping]]] = ..., ep_size: _Optional[int] = ..., ep_load_max_over_mean: _Optional[float] = ..., hottest_experts: _Optional[_Iterable[_Union[ExpertLoad, _Mapping]]] = ..., draining: _Optional[bool] = ..., pp_size: _Optional[int] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("layer", "expert", "tokens")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    tokens: int
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class TPRank(_message.Message):
    __slots__ = ("rank", "node_ip", "pid", "alive", "param_bytes", "kv_head_start", "kv_head_end", "stage", "layer_start", "layer_end", "kv_bytes", "busy_s")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_IP_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_END_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node_ip: str
    pid: int
    alive: bool
    param_bytes: int
    kv_head_start: int
    kv_head_end: int
    stage: int
    layer_start: int
    layer_end: int
    kv_bytes: int
    busy_s: float
    def __init__(self, rank: _Optional[int] = ..., node_ip: _Optional[str] = ..., pid: _Optional[int] = ..., alive: _Optional[bool] = ..., param_bytes: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., kv_head_end: _Optional[int] = ..., stage: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., busy_s: _Optional[float] = ...) -> None: ...

class RouterStatus(_message.Message):
    __slots__ = ("router_id", "grpc_address", "num_inflight", "metrics_url", "http_url")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    HTTP_URL_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    grpc_address: str
    num_inflight: int
    metrics_url: str
    http_url: str
    def __init__(self, router_id: _Optional[str] = ..., grpc_address: _Optional[str] = ..., num_inflight: _Optional[int] = ..., metrics_url: _Optional[str] = ..., http_url: _Optional[str] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("pool", "target_replicas", "num_replicas", "num_starting", "num_restarts", "num_failed_starts", "restart_backoff_s", "last_failure", "num_draining")
    POOL_FIELD_NUMBER: _ClassVar[int]
    TARGET_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    NUM_STARTING_FIELD_NUMBER: _ClassVar[int]
    NUM_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_STARTS_FIELD_NUMBER: _ClassVar[int]
    RESTART_BACKOFF_S_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAINING_FIELD_NUMBER: _ClassVar[int]
    pool: str
    target_replicas: int
    num_replicas: int
    num_starting: int
    num_restarts: int
    num_failed_starts: int
    restart_backoff_s: float
    last_failure: str
    num_draining: int
    def __init__(self, pool: _Optional[str] = ..., target_replicas: _Optional[int] = ..., num_replicas: _Optional[int] = ..., num_starting: _Optional[int] = ..., num_restarts: _Optional[int] = ..., num_failed_starts: _Optional[int] = ..., restart_backoff_s: _Optional[float] = ..., last_failure: _Optional[str] = ..., num_draining: _Optional[int] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("replicas", "routers", "pools", "controller")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ROUTERS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    routers: _containers.RepeatedCompositeFieldContainer[RouterStatus]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    controller: ControllerStatus
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., routers: _Optional[_Iterable[_Union[RouterStatus, _Mapping]]] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ..., controller: _Optional[_Union[ControllerStatus, _Mapping]] = ...) -> None: ...

class ControllerStatus(_message.Message):
    __slots__ = ("generation", "num_restarts", "last_restart_unix_s", "num_router_restarts")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NUM_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LAST_RESTART_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUTER_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    num_restarts: int
    last_restart_unix_s: float
    num_router_restarts: int
    def __init__(self, generation: _Optional[int] = ..., num_restarts: _Optional[int] = ..., last_restart_unix_s: _Optional[float] = ..., num_router_restarts: _Optional[int] = ...) -> None: ...
