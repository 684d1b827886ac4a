from swarm.proto import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CommitPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMMIT_PHASE_BOTH: _ClassVar[CommitPhase]
    COMMIT_PHASE_PREPARE: _ClassVar[CommitPhase]
    COMMIT_PHASE_APPLY: _ClassVar[CommitPhase]

class EagerOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EAGER_NONE: _ClassVar[EagerOp]
    EAGER_STEP: _ClassVar[EagerOp]
    EAGER_AVERAGE: _ClassVar[EagerOp]
    EAGER_LAST: _ClassVar[EagerOp]
    EAGER_MEAN: _ClassVar[EagerOp]
COMMIT_PHASE_BOTH: CommitPhase
COMMIT_PHASE_PREPARE: CommitPhase
COMMIT_PHASE_APPLY: CommitPhase
EAGER_NONE: EagerOp
EAGER_STEP: EagerOp
EAGER_AVERAGE: EagerOp
EAGER_LAST: EagerOp
EAGER_MEAN: EagerOp

class MicrobatchId(_message.Message):
    __slots__ = ("step", "index", "epoch", "ticket")
    STEP_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    step: int
    index: int
    epoch: int
    ticket: bytes
    def __init__(self, step: _Optional[int] = ..., index: _Optional[int] = ..., epoch: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class Receipt(_message.Message):
    __slots__ = ("peer", "stage", "microbatch", "samples", "duplicate")
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
    def __init__(self, peer: _Optional[str] = ..., stage: _Optional[int] = ..., microbatch: _Optional[_Union[MicrobatchId, _Mapping]] = ..., samples: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class StageForwardRequest(_message.Message):
    __slots__ = ("job", "stage", "microbatch", "tensors", "chunk", "reply_codec", "evaluate", "late")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    REPLY_CODEC_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    job: str
    stage: int
    microbatch: MicrobatchId
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    reply_codec: _tensor_pb2.Codec
    evaluate: bool
    late: bool
    def __init__(self, job: _Optional[str] = ..., stage: _Optional[int] = ..., microbatch: _Optional[_Union[MicrobatchId, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ..., reply_codec: _Optional[_Union[_tensor_pb2.Codec, str]] = ..., evaluate: _Optional[bool] = ..., late: _Optional[bool] = ...) -> None: ...

class StageForwardResponse(_message.Message):
    __slots__ = ("tensors", "chunk", "queued_seconds")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    queued_seconds: float
    def __init__(self, tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ..., queued_seconds: _Optional[float] = ...) -> None: ...

class StageBackwardRequest(_message.Message):
    __slots__ = ("job", "stage", "microbatch", "tensors", "chunk", "reply_codec", "accumulate", "need_grad_inputs", "digest_seed", "late")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    REPLY_CODEC_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATE_FIELD_NUMBER: _ClassVar[int]
    NEED_GRAD_INPUTS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_SEED_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    job: str
    stage: int
    microbatch: MicrobatchId
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    reply_codec: _tensor_pb2.Codec
    accumulate: bool
    need_grad_inputs: bool
    digest_seed: int
    late: bool
    def __init__(self, job: _Optional[str] = ..., stage: _Optional[int] = ..., microbatch: _Optional[_Union[MicrobatchId, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ..., reply_codec: _Optional[_Union[_tensor_pb2.Codec, str]] = ..., accumulate: _Optional[bool] = ..., need_grad_inputs: _Optional[bool] = ..., digest_seed: _Optional[int] = ..., late: _Optional[bool] = ...) -> None: ...

class StageBackwardResponse(_message.Message):
    __slots__ = ("tensors", "chunk", "receipt", "queued_seconds", "digest")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    receipt: Receipt
    queued_seconds: float
    digest: SumCheck
    def __init__(self, tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ..., receipt: _Optional[_Union[Receipt, _Mapping]] = ..., queued_seconds: _Optional[float] = ..., digest: _Optional[_Union[SumCheck, _Mapping]] = ...) -> None: ...

class StageForwardBackwardRequest(_message.Message):
    __slots__ = ("job", "stage", "microbatch", "tensors", "chunk", "reply_codec", "accumulate", "need_grad_inputs", "evaluate", "digest_seed", "late")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    REPLY_CODEC_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATE_FIELD_NUMBER: _ClassVar[int]
    NEED_GRAD_INPUTS_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_SEED_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    job: str
    stage: int
    microbatch: MicrobatchId
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    reply_codec: _tensor_pb2.Codec
    accumulate: bool
    need_grad_inputs: bool
    evaluate: bool
    digest_seed: int
    late: bool
    def __init__(self, job: _Optional[str] = ..., stage: _Optional[int] = ..., microbatch: _Optional[_Union[MicrobatchId, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ..., reply_codec: _Optional[_Union[_tensor_pb2.Codec, str]] = ..., accumulate: _Optional[bool] = ..., need_grad_inputs: _Optional[bool] = ..., evaluate: _Optional[bool] = ..., digest_seed: _Optional[int] = ..., late: _Optional[bool] = ...) -> None: ...

class StageForwardBackwardResponse(_message.Message):
    __slots__ = ("tensors", "chunk", "receipt", "loss_sum", "queued_seconds", "digest")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    receipt: Receipt
    loss_sum: float
    queued_seconds: float
    digest: SumCheck
    def __init__(self, tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ..., receipt: _Optional[_Union[Receipt, _Mapping]] = ..., loss_sum: _Optional[float] = ..., queued_seconds: _Optional[float] = ..., digest: _Optional[_Union[SumCheck, _Mapping]] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("peers", "addresses", "throughput")
    PEERS_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedScalarFieldContainer[str]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    throughput: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, peers: _Optional[_Iterable[str]] = ..., addresses: _Optional[_Iterable[str]] = ..., throughput: _Optional[_Iterable[float]] = ...) -> None: ...

class StagePushRequest(_message.Message):
    __slots__ = ("job", "stage", "microbatch", "tensors", "chunk", "accumulate", "route", "need_grad_inputs", "evaluate", "run", "reply", "tickets")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATE_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    NEED_GRAD_INPUTS_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    TICKETS_FIELD_NUMBER: _ClassVar[int]
    job: str
    stage: int
    microbatch: MicrobatchId
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    accumulate: _containers.RepeatedScalarFieldContainer[int]
    route: _containers.RepeatedCompositeFieldContainer[Route]
    need_grad_inputs: bool
    evaluate: bool
    run: int
    reply: _tensor_pb2.Handover
    tickets: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, job: _Optional[str] = ..., stage: _Optional[int] = ..., microbatch: _Optional[_Union[MicrobatchId, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ..., accumulate: _Optional[_Iterable[int]] = ..., route: _Optional[_Iterable[_Union[Route, _Mapping]]] = ..., need_grad_inputs: _Optional[bool] = ..., evaluate: _Optional[bool] = ..., run: _Optional[int] = ..., reply: _Optional[_Union[_tensor_pb2.Handover, _Mapping]] = ..., tickets: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StagePushResponse(_message.Message):
    __slots__ = ("tensors", "chunk", "receipts", "uncertain", "loss_sum", "queued_seconds", "path", "site")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    UNCERTAIN_FIELD_NUMBER: _ClassVar[int]
    LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    receipts: _containers.RepeatedCompositeFieldContainer[Receipt]
    uncertain: _containers.RepeatedScalarFieldContainer[int]
    loss_sum: float
    queued_seconds: float
    path: _containers.RepeatedScalarFieldContainer[str]
    site: str
    def __init__(self, tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ..., receipts: _Optional[_Iterable[_Union[Receipt, _Mapping]]] = ..., uncertain: _Optional[_Iterable[int]] = ..., loss_sum: _Optional[float] = ..., queued_seconds: _Optional[float] = ..., path: _Optional[_Iterable[str]] = ..., site: _Optional[str] = ...) -> None: ...

class Commitment(_message.Message):
    __slots__ = ("peer", "stage", "microbatch", "inputs", "outputs", "grad_outputs", "grad_inputs", "tokens", "targets", "run")
    PEER_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    GRAD_INPUTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    peer: str
    stage: int
    microbatch: MicrobatchId
    inputs: bytes
    outputs: bytes
    grad_outputs: bytes
    grad_inputs: bytes
    tokens: bytes
    targets: bytes
    run: int
    def __init__(self, peer: _Optional[str] = ..., stage: _Optional[int] = ..., microbatch: _Optional[_Union[MicrobatchId, _Mapping]] = ..., inputs: _Optional[bytes] = ..., outputs: _Optional[bytes] = ..., grad_outputs: _Optional[bytes] = ..., grad_inputs: _Optional[bytes] = ..., tokens: _Optional[bytes] = ..., targets: _Optional[bytes] = ..., run: _Optional[int] = ...) -> None: ...

class StageRecordRequest(_message.Message):
    __slots__ = ("job", "stage", "microbatch", "tensors", "chunk", "tensors_too", "run")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TENSORS_TOO_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    job: str
    stage: int
    microbatch: MicrobatchId
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    tensors_too: bool
    run: int
    def __init__(self, job: _Optional[str] = ..., stage: _Optional[int] = ..., microbatch: _Optional[_Union[MicrobatchId, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ..., tensors_too: _Optional[bool] = ..., run: _Optional[int] = ...) -> None: ...

class StageRecordResponse(_message.Message):
    __slots__ = ("tensors", "chunk", "commitment")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    commitment: Commitment
    def __init__(self, tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ..., commitment: _Optional[_Union[Commitment, _Mapping]] = ...) -> None: ...

class StageCommitRequest(_message.Message):
    __slots__ = ("job", "stage", "step", "microbatches", "total_samples", "phase", "group", "group_index", "round", "grad_scale", "round_end", "eager", "part_weights", "contributors", "check_seed", "audit_seeds", "round_ticket", "group_peers")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    GRAD_SCALE_FIELD_NUMBER: _ClassVar[int]
    ROUND_END_FIELD_NUMBER: _ClassVar[int]
    EAGER_FIELD_NUMBER: _ClassVar[int]
    PART_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    CHECK_SEED_FIELD_NUMBER: _ClassVar[int]
    AUDIT_SEEDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_TICKET_FIELD_NUMBER: _ClassVar[int]
    GROUP_PEERS_FIELD_NUMBER: _ClassVar[int]
    job: str
    stage: int
    step: int
    microbatches: _containers.RepeatedScalarFieldContainer[int]
    total_samples: int
    phase: CommitPhase
    group: _containers.RepeatedScalarFieldContainer[str]
    group_index: int
    round: str
    grad_scale: float
    round_end: bool
    eager: EagerOp
    part_weights: _containers.RepeatedScalarFieldContainer[float]
    contributors: int
    check_seed: int
    audit_seeds: _containers.RepeatedScalarFieldContainer[int]
    round_ticket: RoundTicket
    group_peers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job: _Optional[str] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ..., microbatches: _Optional[_Iterable[int]] = ..., total_samples: _Optional[int] = ..., phase: _Optional[_Union[CommitPhase, str]] = ..., group: _Optional[_Iterable[str]] = ..., group_index: _Optional[int] = ..., round: _Optional[str] = ..., grad_scale: _Optional[float] = ..., round_end: _Optional[bool] = ..., eager: _Optional[_Union[EagerOp, str]] = ..., part_weights: _Optional[_Iterable[float]] = ..., contributors: _Optional[int] = ..., check_seed: _Optional[int] = ..., audit_seeds: _Optional[_Iterable[int]] = ..., round_ticket: _Optional[_Union[RoundTicket, _Mapping]] = ..., group_peers: _Optional[_Iterable[str]] = ...) -> None: ...

class RoundTicket(_message.Message):
    __slots__ = ("ticket", "secrets")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    SECRETS_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    secrets: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, ticket: _Optional[bytes] = ..., secrets: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StageCommitResponse(_message.Message):
    __slots__ = ("step", "already_committed", "grad_sq_norm", "sum_checks", "audit_checks")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ALREADY_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    GRAD_SQ_NORM_FIELD_NUMBER: _ClassVar[int]
    SUM_CHECKS_FIELD_NUMBER: _ClassVar[int]
    AUDIT_CHECKS_FIELD_NUMBER: _ClassVar[int]
    step: int
    already_committed: bool
    grad_sq_norm: float
    sum_checks: _containers.RepeatedCompositeFieldContainer[SumCheck]
    audit_checks: _containers.RepeatedCompositeFieldContainer[SumCheck]
    def __init__(self, step: _Optional[int] = ..., already_committed: _Optional[bool] = ..., grad_sq_norm: _Optional[float] = ..., sum_checks: _Optional[_Iterable[_Union[SumCheck, _Mapping]]] = ..., audit_checks: _Optional[_Iterable[_Union[SumCheck, _Mapping]]] = ...) -> None: ...

class SumCheck(_message.Message):
    __slots__ = ("part", "dot", "magnitude", "sum_dot", "unit", "norm", "encoding", "received", "sum_norm", "seed_index", "received_dots", "received_magnitudes", "sum_cross")
    PART_FIELD_NUMBER: _ClassVar[int]
    DOT_FIELD_NUMBER: _ClassVar[int]
    MAGNITUDE_FIELD_NUMBER: _ClassVar[int]
    SUM_DOT_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    NORM_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SUM_NORM_FIELD_NUMBER: _ClassVar[int]
    SEED_INDEX_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_DOTS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_MAGNITUDES_FIELD_NUMBER: _ClassVar[int]
    SUM_CROSS_FIELD_NUMBER: _ClassVar[int]
    part: int
    dot: float
    magnitude: float
    sum_dot: float
    unit: float
    norm: float
    encoding: float
    received: _containers.RepeatedScalarFieldContainer[float]
    sum_norm: float
    seed_index: int
    received_dots: _containers.RepeatedScalarFieldContainer[float]
    received_magnitudes: _containers.RepeatedScalarFieldContainer[float]
    sum_cross: float
    def __init__(self, part: _Optional[int] = ..., dot: _Optional[float] = ..., magnitude: _Optional[float] = ..., sum_dot: _Optional[float] = ..., unit: _Optional[float] = ..., norm: _Optional[float] = ..., encoding: _Optional[float] = ..., received: _Optional[_Iterable[float]] = ..., sum_norm: _Optional[float] = ..., seed_index: _Optional[int] = ..., received_dots: _Optional[_Iterable[float]] = ..., received_magnitudes: _Optional[_Iterable[float]] = ..., sum_cross: _Optional[float] = ...) -> None: ...

class StageDiscardRequest(_message.Message):
    __slots__ = ("job", "stage", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    stage: int
    step: int
    def __init__(self, job: _Optional[str] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class StageDiscardResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...

class StageJoinRequest(_message.Message):
    __slots__ = ("job", "stage", "source", "step", "ticket", "epoch")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    job: str
    stage: int
    source: str
    step: int
    ticket: bytes
    epoch: int
    def __init__(self, job: _Optional[str] = ..., stage: _Optional[int] = ..., source: _Optional[str] = ..., step: _Optional[int] = ..., ticket: _Optional[bytes] = ..., epoch: _Optional[int] = ...) -> None: ...

class StageJoinResponse(_message.Message):
    __slots__ = ("step", "copying")
    STEP_FIELD_NUMBER: _ClassVar[int]
    COPYING_FIELD_NUMBER: _ClassVar[int]
    step: int
    copying: bool
    def __init__(self, step: _Optional[int] = ..., copying: _Optional[bool] = ...) -> None: ...

class StageLoadStateRequest(_message.Message):
    __slots__ = ("job", "stage", "step", "tensors", "chunk", "epoch")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    job: str
    stage: int
    step: int
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    epoch: int
    def __init__(self, job: _Optional[str] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ..., epoch: _Optional[int] = ...) -> None: ...

class StageLoadStateResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class StageInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageInfoResponse(_message.Message):
    __slots__ = ("peer", "job", "stage", "num_stages", "step", "device", "num_parameters", "layers", "pending_microbatches", "receipts", "applied_step", "applied_scale", "next_receipts", "round_synced", "round_samples", "state_epoch", "receipt_runs", "next_receipt_runs", "in_flight")
    PEER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PENDING_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_STEP_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SCALE_FIELD_NUMBER: _ClassVar[int]
    NEXT_RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    ROUND_SYNCED_FIELD_NUMBER: _ClassVar[int]
    ROUND_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STATE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_RUNS_FIELD_NUMBER: _ClassVar[int]
    NEXT_RECEIPT_RUNS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    peer: str
    job: str
    stage: int
    num_stages: int
    step: int
    device: str
    num_parameters: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    pending_microbatches: int
    receipts: _containers.RepeatedScalarFieldContainer[int]
    applied_step: int
    applied_scale: float
    next_receipts: _containers.RepeatedScalarFieldContainer[int]
    round_synced: int
    round_samples: int
    state_epoch: int
    receipt_runs: _containers.RepeatedScalarFieldContainer[int]
    next_receipt_runs: _containers.RepeatedScalarFieldContainer[int]
    in_flight: _containers.RepeatedCompositeFieldContainer[PushInFlight]
    def __init__(self, peer: _Optional[str] = ..., job: _Optional[str] = ..., stage: _Optional[int] = ..., num_stages: _Optional[int] = ..., step: _Optional[int] = ..., device: _Optional[str] = ..., num_parameters: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., pending_microbatches: _Optional[int] = ..., receipts: _Optional[_Iterable[int]] = ..., applied_step: _Optional[int] = ..., applied_scale: _Optional[float] = ..., next_receipts: _Optional[_Iterable[int]] = ..., round_synced: _Optional[int] = ..., round_samples: _Optional[int] = ..., state_epoch: _Optional[int] = ..., receipt_runs: _Optional[_Iterable[int]] = ..., next_receipt_runs: _Optional[_Iterable[int]] = ..., in_flight: _Optional[_Iterable[_Union[PushInFlight, _Mapping]]] = ...) -> None: ...

class PushInFlight(_message.Message):
    __slots__ = ("step", "index", "run")
    STEP_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    step: int
    index: int
    run: int
    def __init__(self, step: _Optional[int] = ..., index: _Optional[int] = ..., run: _Optional[int] = ...) -> None: ...

class StageDownloadStateRequest(_message.Message):
    __slots__ = ("job", "stage", "include_optimizer", "follower", "ticket")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    FOLLOWER_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    job: str
    stage: int
    include_optimizer: bool
    follower: str
    ticket: bytes
    def __init__(self, job: _Optional[str] = ..., stage: _Optional[int] = ..., include_optimizer: _Optional[bool] = ..., follower: _Optional[str] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class StageUpdatesRequest(_message.Message):
    __slots__ = ("job", "stage", "follower", "from_step", "ticket")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    FOLLOWER_FIELD_NUMBER: _ClassVar[int]
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    job: str
    stage: int
    follower: str
    from_step: int
    ticket: bytes
    def __init__(self, job: _Optional[str] = ..., stage: _Optional[int] = ..., follower: _Optional[str] = ..., from_step: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class StageUpdatesResponse(_message.Message):
    __slots__ = ("tensors", "chunk", "step", "total_samples", "grad_scale", "round_end", "eager", "boundary")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    GRAD_SCALE_FIELD_NUMBER: _ClassVar[int]
    ROUND_END_FIELD_NUMBER: _ClassVar[int]
    EAGER_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    step: int
    total_samples: int
    grad_scale: float
    round_end: bool
    eager: EagerOp
    boundary: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ..., step: _Optional[int] = ..., total_samples: _Optional[int] = ..., grad_scale: _Optional[float] = ..., round_end: _Optional[bool] = ..., eager: _Optional[_Union[EagerOp, str]] = ..., boundary: _Optional[int] = ...) -> None: ...

class StageDownloadStateResponse(_message.Message):
    __slots__ = ("tensors", "chunk", "step")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    step: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ..., step: _Optional[int] = ...) -> None: ...
