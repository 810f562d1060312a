from specserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyItem(_message.Message):
    __slots__ = ("request_id", "offset", "tokens", "tree", "params", "traceparent", "state_layers", "prefill")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    STATE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    offset: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    tree: _common_pb2.DraftTree
    params: _common_pb2.SamplingParams
    traceparent: str
    state_layers: _containers.RepeatedScalarFieldContainer[int]
    prefill: bool
    def __init__(self, request_id: _Optional[str] = ..., offset: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., traceparent: _Optional[str] = ..., state_layers: _Optional[_Iterable[int]] = ..., prefill: _Optional[bool] = ...) -> None: ...

class VerifyStep(_message.Message):
    __slots__ = ("step_id", "items", "release")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    items: _containers.RepeatedCompositeFieldContainer[VerifyItem]
    release: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step_id: _Optional[int] = ..., items: _Optional[_Iterable[_Union[VerifyItem, _Mapping]]] = ..., release: _Optional[_Iterable[str]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("request_id", "accepted_nodes", "tokens", "bonus", "need_resync", "states", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    NEED_RESYNC_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    bonus: bool
    need_resync: bool
    states: _common_pb2.HiddenStates
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., accepted_nodes: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., bonus: _Optional[bool] = ..., need_resync: _Optional[bool] = ..., states: _Optional[_Union[_common_pb2.HiddenStates, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("step_id", "verdicts", "timing")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    verdicts: _containers.RepeatedCompositeFieldContainer[Verdict]
    timing: _common_pb2.StepTiming
    def __init__(self, step_id: _Optional[int] = ..., verdicts: _Optional[_Iterable[_Union[Verdict, _Mapping]]] = ..., timing: _Optional[_Union[_common_pb2.StepTiming, _Mapping]] = ...) -> None: ...
