from swarm.proto import control_pb2 as _control_pb2
from swarm.proto import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Replica(_message.Message):
    __slots__ = ("peer", "address", "metrics_address", "device", "state", "samples_per_second", "joining", "reachability", "relay", "reachability_detail", "upload_bytes_per_second", "download_bytes_per_second", "boundary", "activation_capacity", "silent_since")
    PEER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    JOINING_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_DETAIL_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SILENT_SINCE_FIELD_NUMBER: _ClassVar[int]
    peer: str
    address: str
    metrics_address: str
    device: str
    state: _control_pb2.PeerState
    samples_per_second: float
    joining: str
    reachability: _control_pb2.Reachability
    relay: str
    reachability_detail: str
    upload_bytes_per_second: float
    download_bytes_per_second: float
    boundary: _control_pb2.BoundaryTraffic
    activation_capacity: int
    silent_since: float
    def __init__(self, peer: _Optional[str] = ..., address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., device: _Optional[str] = ..., state: _Optional[_Union[_control_pb2.PeerState, str]] = ..., samples_per_second: _Optional[float] = ..., joining: _Optional[str] = ..., reachability: _Optional[_Union[_control_pb2.Reachability, str]] = ..., relay: _Optional[str] = ..., reachability_detail: _Optional[str] = ..., upload_bytes_per_second: _Optional[float] = ..., download_bytes_per_second: _Optional[float] = ..., boundary: _Optional[_Union[_control_pb2.BoundaryTraffic, _Mapping]] = ..., activation_capacity: _Optional[int] = ..., silent_since: _Optional[float] = ...) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("stage", "layers", "replicas")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    stage: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, stage: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job", "name", "state", "step", "steps", "loss", "error", "message", "stages", "samples_per_second", "created", "updated", "spec", "base_dir", "first_loss", "val_loss", "val_step", "waiting_since", "warnings", "events", "rounds", "submitter")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    BASE_DIR_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOSS_FIELD_NUMBER: _ClassVar[int]
    VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    VAL_STEP_FIELD_NUMBER: _ClassVar[int]
    WAITING_SINCE_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SUBMITTER_FIELD_NUMBER: _ClassVar[int]
    job: str
    name: str
    state: _control_pb2.JobState
    step: int
    steps: int
    loss: float
    error: str
    message: str
    stages: _containers.RepeatedCompositeFieldContainer[StageStatus]
    samples_per_second: float
    created: float
    updated: float
    spec: str
    base_dir: str
    first_loss: float
    val_loss: float
    val_step: int
    waiting_since: float
    warnings: _containers.RepeatedScalarFieldContainer[str]
    events: _containers.RepeatedCompositeFieldContainer[JobEvent]
    rounds: RoundStatus
    submitter: str
    def __init__(self, job: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[_control_pb2.JobState, str]] = ..., step: _Optional[int] = ..., steps: _Optional[int] = ..., loss: _Optional[float] = ..., error: _Optional[str] = ..., message: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[StageStatus, _Mapping]]] = ..., samples_per_second: _Optional[float] = ..., created: _Optional[float] = ..., updated: _Optional[float] = ..., spec: _Optional[str] = ..., base_dir: _Optional[str] = ..., first_loss: _Optional[float] = ..., val_loss: _Optional[float] = ..., val_step: _Optional[int] = ..., waiting_since: _Optional[float] = ..., warnings: _Optional[_Iterable[str]] = ..., events: _Optional[_Iterable[_Union[JobEvent, _Mapping]]] = ..., rounds: _Optional[_Union[RoundStatus, _Mapping]] = ..., submitter: _Optional[str] = ...) -> None: ...

class RoundStatus(_message.Message):
    __slots__ = ("rule", "round", "rounds", "round_steps", "next_average_in", "last_seconds", "last_at", "last_bytes")
    RULE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_STEPS_FIELD_NUMBER: _ClassVar[int]
    NEXT_AVERAGE_IN_FIELD_NUMBER: _ClassVar[int]
    LAST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_BYTES_FIELD_NUMBER: _ClassVar[int]
    rule: str
    round: int
    rounds: int
    round_steps: int
    next_average_in: int
    last_seconds: float
    last_at: float
    last_bytes: int
    def __init__(self, rule: _Optional[str] = ..., round: _Optional[int] = ..., rounds: _Optional[int] = ..., round_steps: _Optional[int] = ..., next_average_in: _Optional[int] = ..., last_seconds: _Optional[float] = ..., last_at: _Optional[float] = ..., last_bytes: _Optional[int] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("time", "kind", "text")
    TIME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    time: float
    kind: str
    text: str
    def __init__(self, time: _Optional[float] = ..., kind: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class SchedulerSubmitJobRequest(_message.Message):
    __slots__ = ("spec", "base_dir", "request_id")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    BASE_DIR_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    spec: str
    base_dir: str
    request_id: str
    def __init__(self, spec: _Optional[str] = ..., base_dir: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class SchedulerSubmitJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: JobStatus
    def __init__(self, job: _Optional[_Union[JobStatus, _Mapping]] = ...) -> None: ...

class SchedulerGetJobRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class SchedulerGetJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: JobStatus
    def __init__(self, job: _Optional[_Union[JobStatus, _Mapping]] = ...) -> None: ...

class SchedulerListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class SchedulerListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token", "caller_host")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CALLER_HOST_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    next_page_token: str
    caller_host: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., caller_host: _Optional[str] = ...) -> None: ...

class SchedulerCancelJobRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class SchedulerCancelJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: JobStatus
    def __init__(self, job: _Optional[_Union[JobStatus, _Mapping]] = ...) -> None: ...

class SchedulerDeleteJobRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class SchedulerDeleteJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerExportModelRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class SchedulerExportModelResponse(_message.Message):
    __slots__ = ("tensors", "chunk", "step")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    chunk: _tensor_pb2.Chunk
    step: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ..., step: _Optional[int] = ...) -> None: ...

class SchedulerExportRoutesRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class SchedulerExportRoutesResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class SchedulerFetchDataRequest(_message.Message):
    __slots__ = ("job", "validation", "offset")
    JOB_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    job: str
    validation: bool
    offset: int
    def __init__(self, job: _Optional[str] = ..., validation: _Optional[bool] = ..., offset: _Optional[int] = ...) -> None: ...

class SchedulerFetchDataResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class SchedulerFetchInitRequest(_message.Message):
    __slots__ = ("job", "path", "offset")
    JOB_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    job: str
    path: str
    offset: int
    def __init__(self, job: _Optional[str] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class SchedulerFetchInitResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class LeaseTask(_message.Message):
    __slots__ = ("step", "index", "stages", "evaluate", "audits", "epoch", "tickets", "run")
    STEP_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_FIELD_NUMBER: _ClassVar[int]
    AUDITS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TICKETS_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    step: int
    index: int
    stages: _containers.RepeatedScalarFieldContainer[int]
    evaluate: bool
    audits: _containers.RepeatedCompositeFieldContainer[ContributionAudit]
    epoch: int
    tickets: _containers.RepeatedScalarFieldContainer[bytes]
    run: int
    def __init__(self, step: _Optional[int] = ..., index: _Optional[int] = ..., stages: _Optional[_Iterable[int]] = ..., evaluate: _Optional[bool] = ..., audits: _Optional[_Iterable[_Union[ContributionAudit, _Mapping]]] = ..., epoch: _Optional[int] = ..., tickets: _Optional[_Iterable[bytes]] = ..., run: _Optional[int] = ...) -> None: ...

class ContributionAudit(_message.Message):
    __slots__ = ("stage", "peer", "seed")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    stage: int
    peer: str
    seed: int
    def __init__(self, stage: _Optional[int] = ..., peer: _Optional[str] = ..., seed: _Optional[int] = ...) -> None: ...

class GradientDigest(_message.Message):
    __slots__ = ("stage", "peer", "dot", "magnitude", "norm", "auditors", "seed", "disputed")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    DOT_FIELD_NUMBER: _ClassVar[int]
    MAGNITUDE_FIELD_NUMBER: _ClassVar[int]
    NORM_FIELD_NUMBER: _ClassVar[int]
    AUDITORS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DISPUTED_FIELD_NUMBER: _ClassVar[int]
    stage: int
    peer: str
    dot: float
    magnitude: float
    norm: float
    auditors: str
    seed: int
    disputed: bool
    def __init__(self, stage: _Optional[int] = ..., peer: _Optional[str] = ..., dot: _Optional[float] = ..., magnitude: _Optional[float] = ..., norm: _Optional[float] = ..., auditors: _Optional[str] = ..., seed: _Optional[int] = ..., disputed: _Optional[bool] = ...) -> None: ...

class MicrobatchRef(_message.Message):
    __slots__ = ("step", "index")
    STEP_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    step: int
    index: int
    def __init__(self, step: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class SchedulerLeaseMicrobatchesRequest(_message.Message):
    __slots__ = ("job", "trainer", "count", "wait_s", "working", "trainer_key")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    WORKING_FIELD_NUMBER: _ClassVar[int]
    TRAINER_KEY_FIELD_NUMBER: _ClassVar[int]
    job: str
    trainer: str
    count: int
    wait_s: float
    working: _containers.RepeatedCompositeFieldContainer[MicrobatchRef]
    trainer_key: bytes
    def __init__(self, job: _Optional[str] = ..., trainer: _Optional[str] = ..., count: _Optional[int] = ..., wait_s: _Optional[float] = ..., working: _Optional[_Iterable[_Union[MicrobatchRef, _Mapping]]] = ..., trainer_key: _Optional[bytes] = ...) -> None: ...

class SchedulerLeaseMicrobatchesResponse(_message.Message):
    __slots__ = ("step", "tasks", "replicas", "done")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    step: int
    tasks: _containers.RepeatedCompositeFieldContainer[LeaseTask]
    replicas: _containers.RepeatedCompositeFieldContainer[StageStatus]
    done: bool
    def __init__(self, step: _Optional[int] = ..., tasks: _Optional[_Iterable[_Union[LeaseTask, _Mapping]]] = ..., replicas: _Optional[_Iterable[_Union[StageStatus, _Mapping]]] = ..., done: _Optional[bool] = ...) -> None: ...

class MicrobatchReport(_message.Message):
    __slots__ = ("step", "index", "holders", "loss_sum", "samples", "chain", "back", "verdicts", "touched", "stage_runs", "audit_runs", "digests", "late")
    class HoldersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    class BackEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    BACK_FIELD_NUMBER: _ClassVar[int]
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    TOUCHED_FIELD_NUMBER: _ClassVar[int]
    STAGE_RUNS_FIELD_NUMBER: _ClassVar[int]
    AUDIT_RUNS_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    step: int
    index: int
    holders: _containers.ScalarMap[int, str]
    loss_sum: float
    samples: int
    chain: _containers.RepeatedScalarFieldContainer[str]
    back: _containers.ScalarMap[int, str]
    verdicts: _containers.RepeatedCompositeFieldContainer[Verdict]
    touched: _containers.RepeatedScalarFieldContainer[str]
    stage_runs: int
    audit_runs: int
    digests: _containers.RepeatedCompositeFieldContainer[GradientDigest]
    late: bool
    def __init__(self, step: _Optional[int] = ..., index: _Optional[int] = ..., holders: _Optional[_Mapping[int, str]] = ..., loss_sum: _Optional[float] = ..., samples: _Optional[int] = ..., chain: _Optional[_Iterable[str]] = ..., back: _Optional[_Mapping[int, str]] = ..., verdicts: _Optional[_Iterable[_Union[Verdict, _Mapping]]] = ..., touched: _Optional[_Iterable[str]] = ..., stage_runs: _Optional[int] = ..., audit_runs: _Optional[int] = ..., digests: _Optional[_Iterable[_Union[GradientDigest, _Mapping]]] = ..., late: _Optional[bool] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("peer", "stage", "evidence", "auditors")
    PEER_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    AUDITORS_FIELD_NUMBER: _ClassVar[int]
    peer: str
    stage: int
    evidence: str
    auditors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, peer: _Optional[str] = ..., stage: _Optional[int] = ..., evidence: _Optional[str] = ..., auditors: _Optional[_Iterable[str]] = ...) -> None: ...

class SchedulerReportMicrobatchesRequest(_message.Message):
    __slots__ = ("job", "trainer", "results", "released", "failure", "next", "trainer_key")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    TRAINER_KEY_FIELD_NUMBER: _ClassVar[int]
    job: str
    trainer: str
    results: _containers.RepeatedCompositeFieldContainer[MicrobatchReport]
    released: _containers.RepeatedScalarFieldContainer[int]
    failure: str
    next: SchedulerLeaseMicrobatchesRequest
    trainer_key: bytes
    def __init__(self, job: _Optional[str] = ..., trainer: _Optional[str] = ..., results: _Optional[_Iterable[_Union[MicrobatchReport, _Mapping]]] = ..., released: _Optional[_Iterable[int]] = ..., failure: _Optional[str] = ..., next: _Optional[_Union[SchedulerLeaseMicrobatchesRequest, _Mapping]] = ..., trainer_key: _Optional[bytes] = ...) -> None: ...

class SchedulerReportMicrobatchesResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: SchedulerLeaseMicrobatchesResponse
    def __init__(self, lease: _Optional[_Union[SchedulerLeaseMicrobatchesResponse, _Mapping]] = ...) -> None: ...
