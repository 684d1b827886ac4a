from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

from swarm.proto import tensor_pb2 as _tensor_pb2

DESCRIPTOR: _descriptor.FileDescriptor

class MicrobatchId(_message.Message):
    __slots__ = ("index", "step")
    STEP_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    step: int
    index: int
    def __init__(self, step: int | None = ..., index: int | None = ...) -> None: ...

class Receipt(_message.Message):
    __slots__ = ("duplicate", "microbatch", "peer", "samples", "stage")
    PEER_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    peer: str
    stage: int
    microbatch: MicrobatchId
    samples: int
    duplicate: bool
    def __init__(self, peer: str | None = ..., stage: int | None = ..., microbatch: MicrobatchId | _Mapping | None = ..., samples: int | None = ..., duplicate: bool | None = ...) -> None: ...

class StageForwardRequest(_message.Message):
    __slots__ = ("chunk", "job", "microbatch", "reply_codec", "stage", "tensors")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    REPLY_CODEC_FIELD_NUMBER: _ClassVar[int]
    job: str
    stage: int
    microbatch: MicrobatchId
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    reply_codec: _tensor_pb2.Codec
    def __init__(self, job: str | None = ..., stage: int | None = ..., microbatch: MicrobatchId | _Mapping | None = ..., tensors: _Iterable[_tensor_pb2.Tensor | _Mapping] | None = ..., chunk: _tensor_pb2.Chunk | _Mapping | None = ..., reply_codec: _tensor_pb2.Codec | str | None = ...) -> None: ...

class StageForwardResponse(_message.Message):
    __slots__ = ("chunk", "tensors")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    def __init__(self, tensors: _Iterable[_tensor_pb2.Tensor | _Mapping] | None = ..., chunk: _tensor_pb2.Chunk | _Mapping | None = ...) -> None: ...

class StageBackwardRequest(_message.Message):
    __slots__ = ("accumulate", "chunk", "job", "microbatch", "need_grad_inputs", "reply_codec", "stage", "tensors")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    REPLY_CODEC_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATE_FIELD_NUMBER: _ClassVar[int]
    NEED_GRAD_INPUTS_FIELD_NUMBER: _ClassVar[int]
    job: str
    stage: int
    microbatch: MicrobatchId
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    reply_codec: _tensor_pb2.Codec
    accumulate: bool
    need_grad_inputs: bool
    def __init__(self, job: str | None = ..., stage: int | None = ..., microbatch: MicrobatchId | _Mapping | None = ..., tensors: _Iterable[_tensor_pb2.Tensor | _Mapping] | None = ..., chunk: _tensor_pb2.Chunk | _Mapping | None = ..., reply_codec: _tensor_pb2.Codec | str | None = ..., accumulate: bool | None = ..., need_grad_inputs: bool | None = ...) -> None: ...

class StageBackwardResponse(_message.Message):
    __slots__ = ("chunk", "receipt", "tensors")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    receipt: Receipt
    def __init__(self, tensors: _Iterable[_tensor_pb2.Tensor | _Mapping] | None = ..., chunk: _tensor_pb2.Chunk | _Mapping | None = ..., receipt: Receipt | _Mapping | None = ...) -> None: ...

class StageForwardBackwardRequest(_message.Message):
    __slots__ = ("accumulate", "chunk", "job", "microbatch", "need_grad_inputs", "reply_codec", "stage", "tensors")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    REPLY_CODEC_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATE_FIELD_NUMBER: _ClassVar[int]
    NEED_GRAD_INPUTS_FIELD_NUMBER: _ClassVar[int]
    job: str
    stage: int
    microbatch: MicrobatchId
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    reply_codec: _tensor_pb2.Codec
    accumulate: bool
    need_grad_inputs: bool
    def __init__(self, job: str | None = ..., stage: int | None = ..., microbatch: MicrobatchId | _Mapping | None = ..., tensors: _Iterable[_tensor_pb2.Tensor | _Mapping] | None = ..., chunk: _tensor_pb2.Chunk | _Mapping | None = ..., reply_codec: _tensor_pb2.Codec | str | None = ..., accumulate: bool | None = ..., need_grad_inputs: bool | None = ...) -> None: ...

class StageForwardBackwardResponse(_message.Message):
    __slots__ = ("chunk", "loss_sum", "receipt", "tensors")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    receipt: Receipt
    loss_sum: float
    def __init__(self, tensors: _Iterable[_tensor_pb2.Tensor | _Mapping] | None = ..., chunk: _tensor_pb2.Chunk | _Mapping | None = ..., receipt: Receipt | _Mapping | None = ..., loss_sum: float | None = ...) -> None: ...

class StageCommitRequest(_message.Message):
    __slots__ = ("job", "microbatches", "stage", "step", "total_samples")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    job: str
    stage: int
    step: int
    microbatches: _containers.RepeatedScalarFieldContainer[int]
    total_samples: int
    def __init__(self, job: str | None = ..., stage: int | None = ..., step: int | None = ..., microbatches: _Iterable[int] | None = ..., total_samples: int | None = ...) -> None: ...

class StageCommitResponse(_message.Message):
    __slots__ = ("already_committed", "step")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ALREADY_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    step: int
    already_committed: bool
    def __init__(self, step: int | None = ..., already_committed: bool | None = ...) -> None: ...

class StageInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageInfoResponse(_message.Message):
    __slots__ = ("device", "job", "layers", "num_parameters", "num_stages", "peer", "pending_microbatches", "stage", "step")
    PEER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PENDING_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    peer: str
    job: str
    stage: int
    num_stages: int
    step: int
    device: str
    num_parameters: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    pending_microbatches: int
    def __init__(self, peer: str | None = ..., job: str | None = ..., stage: int | None = ..., num_stages: int | None = ..., step: int | None = ..., device: str | None = ..., num_parameters: int | None = ..., layers: _Iterable[int] | None = ..., pending_microbatches: int | None = ...) -> None: ...

class StageDownloadStateRequest(_message.Message):
    __slots__ = ("include_optimizer", "job", "stage")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    job: str
    stage: int
    include_optimizer: bool
    def __init__(self, job: str | None = ..., stage: int | None = ..., include_optimizer: bool | None = ...) -> None: ...

class StageDownloadStateResponse(_message.Message):
    __slots__ = ("chunk", "step", "tensors")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    step: int
    def __init__(self, tensors: _Iterable[_tensor_pb2.Tensor | _Mapping] | None = ..., chunk: _tensor_pb2.Chunk | _Mapping | None = ..., step: int | None = ...) -> None: ...
