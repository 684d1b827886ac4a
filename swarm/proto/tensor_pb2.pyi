from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_NONE: _ClassVar[Codec]
    CODEC_FP16: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8_BLOCKWISE: _ClassVar[Codec]
    CODEC_HADAMARD3: _ClassVar[Codec]
CODEC_NONE: Codec
CODEC_FP16: Codec
CODEC_BF16: Codec
CODEC_INT8_BLOCKWISE: Codec
CODEC_HADAMARD3: Codec

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "codec", "data", "nbytes", "block_size", "handover")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: Codec
    data: bytes
    nbytes: int
    block_size: int
    handover: Handover
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[_Union[Codec, str]] = ..., data: _Optional[bytes] = ..., nbytes: _Optional[int] = ..., block_size: _Optional[int] = ..., handover: _Optional[_Union[Handover, _Mapping]] = ...) -> None: ...

class Handover(_message.Message):
    __slots__ = ("shm", "cuda")
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    shm: str
    cuda: CudaIpc
    def __init__(self, shm: _Optional[str] = ..., cuda: _Optional[_Union[CudaIpc, _Mapping]] = ...) -> None: ...

class CudaIpc(_message.Message):
    __slots__ = ("device", "storage", "storage_bytes", "storage_offset_bytes", "ref_counter", "ref_counter_offset", "event", "event_sync_required", "offset")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    device: int
    storage: bytes
    storage_bytes: int
    storage_offset_bytes: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes
    event_sync_required: bool
    offset: int
    def __init__(self, device: _Optional[int] = ..., storage: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., offset: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("tensor", "data")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    tensor: int
    data: bytes
    def __init__(self, tensor: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
