# DO NOT EDIT: generated from proto/worker.proto by grpcio-tools 1.85.1 (python -m proto.generate).
from proto import splitserve_pb2 as _splitserve_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestError(_message.Message):
    __slots__ = ("code", "message")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CODE_UNSPECIFIED: _ClassVar[RequestError.Code]
        INVALID_ARGUMENT: _ClassVar[RequestError.Code]
        RESOURCE_EXHAUSTED: _ClassVar[RequestError.Code]
        UNAVAILABLE: _ClassVar[RequestError.Code]
        INTERNAL: _ClassVar[RequestError.Code]
        FAILED_PRECONDITION: _ClassVar[RequestError.Code]
        REPLICA_FAILED: _ClassVar[RequestError.Code]
    CODE_UNSPECIFIED: RequestError.Code
    INVALID_ARGUMENT: RequestError.Code
    RESOURCE_EXHAUSTED: RequestError.Code
    UNAVAILABLE: RequestError.Code
    INTERNAL: RequestError.Code
    FAILED_PRECONDITION: RequestError.Code
    REPLICA_FAILED: RequestError.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: RequestError.Code
    message: str
    def __init__(self, code: _Optional[_Union[RequestError.Code, str]] = ..., message: _Optional[str] = ...) -> None: ...

class WorkerEvent(_message.Message):
    __slots__ = ("response", "error", "request_id")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    response: _splitserve_pb2.GenerateResponse
    error: RequestError
    request_id: str
    def __init__(self, response: _Optional[_Union[_splitserve_pb2.GenerateResponse, _Mapping]] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class WorkerEventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[WorkerEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[WorkerEvent, _Mapping]]] = ...) -> None: ...

class RequestPlaneEndpoint(_message.Message):
    __slots__ = ("host", "port", "token")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    token: bytes
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

class RouterMessage(_message.Message):
    __slots__ = ("open", "submit", "cancel")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    open: OpenChannel
    submit: Submit
    cancel: Cancel
    def __init__(self, open: _Optional[_Union[OpenChannel, _Mapping]] = ..., submit: _Optional[_Union[Submit, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ...) -> None: ...

class OpenChannel(_message.Message):
    __slots__ = ("channel_id", "token")
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    token: bytes
    def __init__(self, channel_id: _Optional[str] = ..., token: _Optional[bytes] = ...) -> None: ...

class Submit(_message.Message):
    __slots__ = ("request", "prefill_replica_id", "resume_token_ids")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    PREFILL_REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request: _splitserve_pb2.GenerateRequest
    prefill_replica_id: str
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request: _Optional[_Union[_splitserve_pb2.GenerateRequest, _Mapping]] = ..., prefill_replica_id: _Optional[str] = ..., resume_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...
