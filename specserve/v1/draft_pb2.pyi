from specserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeItem(_message.Message):
    __slots__ = ("request_id", "offset", "tokens", "draft_length", "tree_size", "params", "traceparent", "states", "prefill")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TREE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    offset: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_length: int
    tree_size: int
    params: _common_pb2.SamplingParams
    traceparent: str
    states: _containers.RepeatedCompositeFieldContainer[_common_pb2.HiddenStates]
    prefill: bool
    def __init__(self, request_id: _Optional[str] = ..., offset: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., draft_length: _Optional[int] = ..., tree_size: _Optional[int] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., traceparent: _Optional[str] = ..., states: _Optional[_Iterable[_Union[_common_pb2.HiddenStates, _Mapping]]] = ..., prefill: _Optional[bool] = ...) -> None: ...

class ProposeStep(_message.Message):
    __slots__ = ("step_id", "items", "release")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    items: _containers.RepeatedCompositeFieldContainer[ProposeItem]
    release: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step_id: _Optional[int] = ..., items: _Optional[_Iterable[_Union[ProposeItem, _Mapping]]] = ..., release: _Optional[_Iterable[str]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("request_id", "tree", "need_resync")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    NEED_RESYNC_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tree: _common_pb2.DraftTree
    need_resync: bool
    def __init__(self, request_id: _Optional[str] = ..., tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., need_resync: _Optional[bool] = ...) -> None: ...

class ProposeResult(_message.Message):
    __slots__ = ("step_id", "proposals", "timing")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    timing: _common_pb2.StepTiming
    def __init__(self, step_id: _Optional[int] = ..., proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ..., timing: _Optional[_Union[_common_pb2.StepTiming, _Mapping]] = ...) -> None: ...
