from swarm.proto import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolReduceRequest(_message.Message):
    __slots__ = ("job", "stage", "round", "part", "sender", "group_size", "tensors", "chunk", "slice", "contributors", "proof")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    job: str
    stage: int
    round: str
    part: int
    sender: int
    group_size: int
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    slice: int
    contributors: int
    proof: MemberProof
    def __init__(self, job: _Optional[str] = ..., stage: _Optional[int] = ..., round: _Optional[str] = ..., part: _Optional[int] = ..., sender: _Optional[int] = ..., group_size: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ..., slice: _Optional[int] = ..., contributors: _Optional[int] = ..., proof: _Optional[_Union[MemberProof, _Mapping]] = ...) -> None: ...

class MemberProof(_message.Message):
    __slots__ = ("ticket", "digests", "secret", "peers")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    digests: _containers.RepeatedScalarFieldContainer[bytes]
    secret: bytes
    peers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ticket: _Optional[bytes] = ..., digests: _Optional[_Iterable[bytes]] = ..., secret: _Optional[bytes] = ..., peers: _Optional[_Iterable[str]] = ...) -> None: ...

class PoolReduceResponse(_message.Message):
    __slots__ = ("tensors", "chunk")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    def __init__(self, tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ...) -> None: ...
