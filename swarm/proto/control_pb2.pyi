from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PeerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PEER_STATE_UNSPECIFIED: _ClassVar[PeerState]
    PEER_STATE_JOINING: _ClassVar[PeerState]
    PEER_STATE_SERVING: _ClassVar[PeerState]
    PEER_STATE_DRAINING: _ClassVar[PeerState]
    PEER_STATE_OFFLINE: _ClassVar[PeerState]
    PEER_STATE_STANDBY: _ClassVar[PeerState]

class PeerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PEER_ROLE_STAGE_SERVER: _ClassVar[PeerRole]
    PEER_ROLE_RELAY: _ClassVar[PeerRole]
    PEER_ROLE_AGGREGATOR: _ClassVar[PeerRole]

class Reachability(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REACHABILITY_UNKNOWN: _ClassVar[Reachability]
    REACHABILITY_DIRECT: _ClassVar[Reachability]
    REACHABILITY_RELAYED: _ClassVar[Reachability]
    REACHABILITY_UNREACHABLE: _ClassVar[Reachability]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_PLACING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
    JOB_STATE_STALLED: _ClassVar[JobState]
PEER_STATE_UNSPECIFIED: PeerState
PEER_STATE_JOINING: PeerState
PEER_STATE_SERVING: PeerState
PEER_STATE_DRAINING: PeerState
PEER_STATE_OFFLINE: PeerState
PEER_STATE_STANDBY: PeerState
PEER_ROLE_STAGE_SERVER: PeerRole
PEER_ROLE_RELAY: PeerRole
PEER_ROLE_AGGREGATOR: PeerRole
REACHABILITY_UNKNOWN: Reachability
REACHABILITY_DIRECT: Reachability
REACHABILITY_RELAYED: Reachability
REACHABILITY_UNREACHABLE: Reachability
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_PLACING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
JOB_STATE_STALLED: JobState

class PeerAnnouncement(_message.Message):
    __slots__ = ("peer", "address", "metrics_address", "device", "state", "job", "stage", "samples_per_second", "throttle", "time", "memory_bytes", "role", "relay", "relay_address", "upload_bytes_per_second", "download_bytes_per_second", "incarnation", "host_id", "public_address", "refused_job", "refused")
    class SamplesPerSecondEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    PEER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    THROTTLE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    RELAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_JOB_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    peer: str
    address: str
    metrics_address: str
    device: str
    state: PeerState
    job: str
    stage: int
    samples_per_second: _containers.ScalarMap[int, float]
    throttle: float
    time: float
    memory_bytes: int
    role: PeerRole
    relay: str
    relay_address: str
    upload_bytes_per_second: float
    download_bytes_per_second: float
    incarnation: str
    host_id: str
    public_address: str
    refused_job: str
    refused: str
    def __init__(self, peer: _Optional[str] = ..., address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., device: _Optional[str] = ..., state: _Optional[_Union[PeerState, str]] = ..., job: _Optional[str] = ..., stage: _Optional[int] = ..., samples_per_second: _Optional[_Mapping[int, float]] = ..., throttle: _Optional[float] = ..., time: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., role: _Optional[_Union[PeerRole, str]] = ..., relay: _Optional[str] = ..., relay_address: _Optional[str] = ..., upload_bytes_per_second: _Optional[float] = ..., download_bytes_per_second: _Optional[float] = ..., incarnation: _Optional[str] = ..., host_id: _Optional[str] = ..., public_address: _Optional[str] = ..., refused_job: _Optional[str] = ..., refused: _Optional[str] = ...) -> None: ...

class ReachabilityReport(_message.Message):
    __slots__ = ("peer", "reachability", "address", "relay", "detail", "remedy", "time")
    PEER_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    REMEDY_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    peer: str
    reachability: Reachability
    address: str
    relay: str
    detail: str
    remedy: str
    time: float
    def __init__(self, peer: _Optional[str] = ..., reachability: _Optional[_Union[Reachability, str]] = ..., address: _Optional[str] = ..., relay: _Optional[str] = ..., detail: _Optional[str] = ..., remedy: _Optional[str] = ..., time: _Optional[float] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("peer", "job", "stage", "queue_depth", "in_flight", "ema_seconds_per_sample", "time", "boundary", "activation_capacity")
    PEER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    EMA_SECONDS_PER_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    peer: str
    job: str
    stage: int
    queue_depth: int
    in_flight: int
    ema_seconds_per_sample: float
    time: float
    boundary: BoundaryTraffic
    activation_capacity: int
    def __init__(self, peer: _Optional[str] = ..., job: _Optional[str] = ..., stage: _Optional[int] = ..., queue_depth: _Optional[int] = ..., in_flight: _Optional[int] = ..., ema_seconds_per_sample: _Optional[float] = ..., time: _Optional[float] = ..., boundary: _Optional[_Union[BoundaryTraffic, _Mapping]] = ..., activation_capacity: _Optional[int] = ...) -> None: ...

class BoundaryTraffic(_message.Message):
    __slots__ = ("forward_bytes", "forward_tokens", "backward_bytes", "backward_tokens")
    FORWARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    forward_bytes: int
    forward_tokens: int
    backward_bytes: int
    backward_tokens: int
    def __init__(self, forward_bytes: _Optional[int] = ..., forward_tokens: _Optional[int] = ..., backward_bytes: _Optional[int] = ..., backward_tokens: _Optional[int] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("job", "peer", "stage", "generation")
    JOB_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    job: str
    peer: str
    stage: int
    generation: int
    def __init__(self, job: _Optional[str] = ..., peer: _Optional[str] = ..., stage: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class JobAnnouncement(_message.Message):
    __slots__ = ("job", "name", "state", "step", "steps", "loss", "spec", "error", "time", "scheduler_key")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_KEY_FIELD_NUMBER: _ClassVar[int]
    job: str
    name: str
    state: JobState
    step: int
    steps: int
    loss: float
    spec: str
    error: str
    time: float
    scheduler_key: bytes
    def __init__(self, job: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., step: _Optional[int] = ..., steps: _Optional[int] = ..., loss: _Optional[float] = ..., spec: _Optional[str] = ..., error: _Optional[str] = ..., time: _Optional[float] = ..., scheduler_key: _Optional[bytes] = ...) -> None: ...

class StepCommitted(_message.Message):
    __slots__ = ("job", "step", "loss", "samples", "time", "val_loss")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    loss: float
    samples: int
    time: float
    val_loss: float
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., samples: _Optional[int] = ..., time: _Optional[float] = ..., val_loss: _Optional[float] = ...) -> None: ...
