from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_NONE: _ClassVar[Codec]
    CODEC_FP16: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8_BLOCKWISE: _ClassVar[Codec]
CODEC_NONE: Codec
CODEC_FP16: Codec
CODEC_BF16: Codec
CODEC_INT8_BLOCKWISE: Codec

class Tensor(_message.Message):
    __slots__ = ("block_size", "codec", "data", "dtype", "name", "nbytes", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: Codec
    data: bytes
    nbytes: int
    block_size: int
    def __init__(self, name: str | None = ..., dtype: str | None = ..., shape: _Iterable[int] | None = ..., codec: Codec | str | None = ..., data: bytes | None = ..., nbytes: int | None = ..., block_size: int | None = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("data", "tensor")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    tensor: int
    data: bytes
    def __init__(self, tensor: int | None = ..., data: bytes | None = ...) -> None: ...
