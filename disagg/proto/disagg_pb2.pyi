from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ("kv_host", "kv_port", "kv_rank_ports")
    KV_HOST_FIELD_NUMBER: _ClassVar[int]
    KV_PORT_FIELD_NUMBER: _ClassVar[int]
    KV_RANK_PORTS_FIELD_NUMBER: _ClassVar[int]
    kv_host: str
    kv_port: int
    kv_rank_ports: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kv_host: _Optional[str] = ..., kv_port: _Optional[int] = ..., kv_rank_ports: _Optional[_Iterable[int]] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("model_name", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_size", "kv_connector", "kv_ip", "kv_port", "protocol_version", "kv_rank_heads")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CONNECTOR_FIELD_NUMBER: _ClassVar[int]
    KV_IP_FIELD_NUMBER: _ClassVar[int]
    KV_PORT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_RANK_HEADS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_connector: str
    kv_ip: str
    kv_port: int
    protocol_version: int
    kv_rank_heads: _containers.RepeatedCompositeFieldContainer[HeadRange]
    def __init__(self, model_name: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_connector: _Optional[str] = ..., kv_ip: _Optional[str] = ..., kv_port: _Optional[int] = ..., protocol_version: _Optional[int] = ..., kv_rank_heads: _Optional[_Iterable[_Union[HeadRange, _Mapping]]] = ...) -> None: ...

class HeadRange(_message.Message):
    __slots__ = ("first_head", "end_head")
    FIRST_HEAD_FIELD_NUMBER: _ClassVar[int]
    END_HEAD_FIELD_NUMBER: _ClassVar[int]
    first_head: int
    end_head: int
    def __init__(self, first_head: _Optional[int] = ..., end_head: _Optional[int] = ...) -> None: ...

class SamplingFields(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "ignore_eos", "structured")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    structured: StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "value", "after_tokens")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    AFTER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    value: str
    after_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[str] = ..., value: _Optional[str] = ..., after_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv_dest_host", "kv_dest_port", "skip_tokens", "pull_from", "pull_blocks", "kv_ranks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_DEST_HOST_FIELD_NUMBER: _ClassVar[int]
    KV_DEST_PORT_FIELD_NUMBER: _ClassVar[int]
    SKIP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULL_FROM_FIELD_NUMBER: _ClassVar[int]
    PULL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_RANKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingFields
    kv_dest_host: str
    kv_dest_port: int
    skip_tokens: int
    pull_from: str
    pull_blocks: int
    kv_ranks: _containers.RepeatedCompositeFieldContainer[KVRank]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingFields, _Mapping]] = ..., kv_dest_host: _Optional[str] = ..., kv_dest_port: _Optional[int] = ..., skip_tokens: _Optional[int] = ..., pull_from: _Optional[str] = ..., pull_blocks: _Optional[int] = ..., kv_ranks: _Optional[_Iterable[_Union[KVRank, _Mapping]]] = ...) -> None: ...

class KVRank(_message.Message):
    __slots__ = ("host", "port", "first_head", "end_head")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    FIRST_HEAD_FIELD_NUMBER: _ClassVar[int]
    END_HEAD_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    first_head: int
    end_head: int
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., first_head: _Optional[int] = ..., end_head: _Optional[int] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("num_cached_tokens", "kv_bytes", "prefill_seconds")
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    kv_bytes: int
    prefill_seconds: float
    def __init__(self, num_cached_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., prefill_seconds: _Optional[float] = ...) -> None: ...

class PrefillProgress(_message.Message):
    __slots__ = ("engine_steps", "num_computed_tokens", "step_seconds", "step_expected_seconds")
    ENGINE_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_EXPECTED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    engine_steps: int
    num_computed_tokens: int
    step_seconds: float
    step_expected_seconds: float
    def __init__(self, engine_steps: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., step_seconds: _Optional[float] = ..., step_expected_seconds: _Optional[float] = ...) -> None: ...

class PrefillUpdate(_message.Message):
    __slots__ = ("progress", "done")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    progress: PrefillProgress
    done: PrefillReply
    def __init__(self, progress: _Optional[_Union[PrefillProgress, _Mapping]] = ..., done: _Optional[_Union[PrefillReply, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "kv_dest_host", "kv_dest_port")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_DEST_HOST_FIELD_NUMBER: _ClassVar[int]
    KV_DEST_PORT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_dest_host: str
    kv_dest_port: int
    def __init__(self, request_id: _Optional[str] = ..., kv_dest_host: _Optional[str] = ..., kv_dest_port: _Optional[int] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class FetchBlocksRequest(_message.Message):
    __slots__ = ("request_id", "hashes", "kv_dest_host", "kv_dest_port")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    KV_DEST_HOST_FIELD_NUMBER: _ClassVar[int]
    KV_DEST_PORT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    hashes: _containers.RepeatedScalarFieldContainer[int]
    kv_dest_host: str
    kv_dest_port: int
    def __init__(self, request_id: _Optional[str] = ..., hashes: _Optional[_Iterable[int]] = ..., kv_dest_host: _Optional[str] = ..., kv_dest_port: _Optional[int] = ...) -> None: ...

class FetchBlocksReply(_message.Message):
    __slots__ = ("num_blocks", "kv_bytes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    kv_bytes: int
    def __init__(self, num_blocks: _Optional[int] = ..., kv_bytes: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "queued_prefill_tokens", "prefill_tokens_per_s", "step_base_seconds")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STEP_BASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int
    prefill_tokens_per_s: float
    step_base_seconds: float
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., step_base_seconds: _Optional[float] = ...) -> None: ...

class KVSnapshot(_message.Message):
    __slots__ = ("seq", "block_size", "tiers")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    block_size: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierHashes]
    def __init__(self, seq: _Optional[int] = ..., block_size: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierHashes, _Mapping]]] = ...) -> None: ...

class TierHashes(_message.Message):
    __slots__ = ("medium", "hashes")
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    medium: str
    hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, medium: _Optional[str] = ..., hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("seq", "stored", "removed", "medium")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    seq: int
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    medium: str
    def __init__(self, seq: _Optional[int] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., medium: _Optional[str] = ...) -> None: ...

class NodeState(_message.Message):
    __slots__ = ("load", "snapshot", "events")
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    load: NodeLoad
    snapshot: KVSnapshot
    events: KVEventBatch
    def __init__(self, load: _Optional[_Union[NodeLoad, _Mapping]] = ..., snapshot: _Optional[_Union[KVSnapshot, _Mapping]] = ..., events: _Optional[_Union[KVEventBatch, _Mapping]] = ...) -> None: ...
