"""KVTransferConfig: how a node takes part in disaggregation, with vLLM's field names."""

import hashlib
import hmac
import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from disagg.vllm_connectors import VLLM_CONNECTORS, KVTiers, translate

if TYPE_CHECKING:  # the pipes import torch; the command line reads this module without it
    from disagg.pipes.base import PipeConfig

logger = logging.getLogger(__name__)

MIN_TOKEN_BYTES = 16  # an auth_token shorter than this is refused: anyone could guess it
MAKE_TOKEN = 'python -c "import secrets; print(secrets.token_hex(16))"'


def check_auth_token(token: object) -> None:
    """An auth_token is a secret of at least MIN_TOKEN_BYTES bytes, or absent (None). An empty or short
    one would turn auth on in name only: every key derived from it is as guessable as it is."""
    if token is None:
        return
    if not isinstance(token, str):
        raise ValueError(f"kv_connector_extra_config.auth_token must be a string, got {type(token).__name__}")
    if len(token.encode()) < MIN_TOKEN_BYTES:
        raise ValueError(f"kv_connector_extra_config.auth_token (or $DISAGG_KV_AUTH_TOKEN) is {len(token.encode())} "
                         f"bytes; it must be at least {MIN_TOKEN_BYTES}: make one with {MAKE_TOKEN} and give every "
                         "node the same, or leave it out (loopback only)")


def derived_key(secret: str | None, purpose: str) -> str | None:
    """A key for one use of the shared secret: gRPC metadata travels in the clear, so whoever
    reads it must not learn the pipe's key (nor the secret)."""
    if secret is None:
        return None
    return hmac.new(secret.encode(), f"disagg {purpose}".encode(), hashlib.sha256).hexdigest()


ROLES = {"producer": "producer", "kv_producer": "producer", "consumer": "consumer",
         "kv_consumer": "consumer", "both": "both", "kv_both": "both"}
PIPE_NAMES = ("tcp", "torch_dist", "ucx", "nixl")
# What kv_connector_extra_config may hold, with defaults.
EXTRA_DEFAULTS: dict[str, object] = {
    "auth_token": None,  # shared secret between nodes: gRPC metadata and the pipe handshake
    "pipe_timeout": 30.0,  # seconds a pipe send/recv may stall
    "lookup_timeout": 30.0,  # seconds a decode node waits for a prompt's KV
    "prefill_timeout": 10.0,  # seconds a decode node waits for a prefill node that makes no progress
    "buffer_ttl": 60.0,  # seconds an unclaimed entry is kept
    "insert_timeout": 5.0,  # seconds a prefill node waits for buffer space
    "prefill_policy": "recompute",  # when the prefill node fails: "recompute" here or "fail" with 503
    # Which prompts a decode node sends to a prefill node: "always", "never", or "auto": whichever route
    # its measured costs say is cheaper (decode_node/route.py).
    "remote_prefill": "auto",
    # "auto" before the costs are measured: prompts of which more than this many tokens miss the decode
    # node's prefix cache go out, the others are computed here. 64: computing 64 tokens in the decode
    # batch costs it about one decode step's worth of extra work, while the handoff adds a fixed cost to
    # the first token (a gRPC call, the KV's way back over the pipe, its load: several ms) that a prompt
    # this short would not win back on the prefill node.
    "local_prefill_max_tokens": 64,
    "layerwise": True,  # a prefill node sends each layer's KV as soon as it is computed, else all at the end
    # Prompts with fewer tokens to send go whole even when layerwise; None: LAYERWISE_MIN_TOKENS_GPU on
    # a GPU, 0 elsewhere (a CPU's prefill is slow beside a part's cost, so every prompt gains).
    "layerwise_min_tokens": None,
    # A prefill node listens on its kv_port for prefix blocks it pulls from other prefill nodes, on a decode
    # node's hint (prefill_node/pull.py); false: it computes them, and its kv_port stays only its name.
    "prefix_pull": True,
}
EXTRA_NUMBERS = ("pipe_timeout", "lookup_timeout", "prefill_timeout", "buffer_ttl", "insert_timeout")
REMOTE_PREFILL = ("auto", "always", "never")
# On an H200 pair each layer part costs both engines more than the overlap saves below about 4k tokens
# (BENCHMARKS.md, "TTFT, one request at a time").
LAYERWISE_MIN_TOKENS_GPU = 4096
# vLLM fields that mean nothing here: accepted, so that vLLM's configs start, with a warning.
IGNORED = ("engine_id", "kv_connector_module_path")


def number(field: str, value: object, kind: type) -> int | float:
    """vLLM's (pydantic's) conversion: a number given as a string, as vLLM's docs write kv_port, is read
    as one; anything else that is not a number of that kind is refused, naming the field."""
    what = "an integer" if kind is int else "a number"
    if isinstance(value, str):
        try:
            value = float(value) if kind is float else int(value.strip())
        except ValueError:
            raise ValueError(f"{field} must be {what}, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise ValueError(f"{field} must be {what}, got {value!r}")
    return kind(value)


@dataclass
class KVTransferConfig:
    """vLLM's --kv-transfer-config fields; kv_connector names the pipe."""

    kv_connector: str = "tcp"
    kv_role: str = "both"
    kv_rank: int | None = None
    kv_parallel_size: int = 2
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_buffer_size: float = 1e9  # bytes of KV a prefill node holds unsent (inserts wait), a decode node unclaimed
    kv_buffer_device: str = "cpu"
    kv_connector_extra_config: dict | None = None
    kv_load_failure_policy: str | None = None  # vLLM's name for kv_connector_extra_config.prefill_policy
    engine_id: str | None = None  # ignored
    kv_connector_module_path: str | None = None  # ignored
    # The KV tiers a vLLM connector name asked for (OffloadingConnector, LMCache...): engine settings.
    tiers: KVTiers = field(default_factory=KVTiers, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in IGNORED:
            if getattr(self, name) is not None:
                logger.warning("--kv-transfer-config: %s is ignored by disagg", name)
        if self.kv_rank is not None:
            self.kv_rank = number("kv_rank", self.kv_rank, int)
        self.kv_parallel_size = number("kv_parallel_size", self.kv_parallel_size, int)
        self.kv_port = number("kv_port", self.kv_port, int)
        self.kv_buffer_size = number("kv_buffer_size", self.kv_buffer_size, float)
        if self.kv_connector not in PIPE_NAMES:
            raise ValueError(f"kv_connector {self.kv_connector!r} is not a known pipe; choose one of "
                             f"{', '.join(PIPE_NAMES)}, or one of vLLM's connectors {', '.join(VLLM_CONNECTORS)}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_role {self.kv_role!r} is not a role; choose producer, consumer or both")
        self.kv_role = ROLES[self.kv_role]
        if not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_port {self.kv_port} is not a port number")
        if self.kv_buffer_size <= 0:
            raise ValueError(f"kv_buffer_size must be positive, got {self.kv_buffer_size}")
        if self.kv_buffer_device not in ("cpu", "cuda"):
            raise ValueError(f"kv_buffer_device must be 'cpu' or 'cuda', got {self.kv_buffer_device!r}")
        extra = dict(self.kv_connector_extra_config or {})
        unknown = set(extra) - set(EXTRA_DEFAULTS)
        if unknown:
            raise ValueError(f"kv_connector_extra_config has unknown field(s) {sorted(unknown)}; "
                             f"known: {sorted(EXTRA_DEFAULTS)}")
        for name in EXTRA_NUMBERS:
            if extra.get(name) is not None:
                extra[name] = number(f"kv_connector_extra_config.{name}", extra[name], float)
        for name in ("local_prefill_max_tokens", "layerwise_min_tokens"):
            if extra.get(name) is not None:
                extra[name] = number(f"kv_connector_extra_config.{name}", extra[name], int)
                if extra[name] < 0:
                    raise ValueError(f"kv_connector_extra_config.{name} must be 0 or more, got {extra[name]}")
        if self.kv_load_failure_policy is not None:
            if extra.get("prefill_policy", self.kv_load_failure_policy) != self.kv_load_failure_policy:
                raise ValueError(f"kv_load_failure_policy {self.kv_load_failure_policy!r} disagrees with "
                                 f"kv_connector_extra_config.prefill_policy {extra['prefill_policy']!r}; give one")
            extra["prefill_policy"] = self.kv_load_failure_policy
        self.kv_connector_extra_config = {**EXTRA_DEFAULTS, **extra}
        check_auth_token(self.extra("auth_token"))
        for name in ("layerwise", "prefix_pull"):
            if not isinstance(self.extra(name), bool):
                raise ValueError(f"kv_connector_extra_config.{name} must be true or false, got {self.extra(name)!r}")
        if self.extra("prefill_policy") not in ("recompute", "fail"):
            raise ValueError("kv_load_failure_policy (kv_connector_extra_config.prefill_policy) must be "
                             "'recompute' or 'fail'")
        if self.extra("remote_prefill") not in REMOTE_PREFILL:
            raise ValueError(f"kv_connector_extra_config.remote_prefill must be one of {', '.join(REMOTE_PREFILL)}, "
                             f"got {self.extra('remote_prefill')!r}")

    def extra(self, key: str):
        return self.kv_connector_extra_config[key]

    def layerwise_min_tokens(self, device_type: str) -> int:
        chosen = self.extra("layerwise_min_tokens")
        if chosen is not None:
            return chosen
        return LAYERWISE_MIN_TOKENS_GPU if device_type == "cuda" else 0

    def pipe_config(self) -> "PipeConfig":
        """This node's own pipe endpoint, with the pipe's key and stall timeout."""
        from disagg.pipes.base import PipeConfig

        check_auth_token(self.extra("auth_token"))  # it may have been set since (from the environment)
        return PipeConfig(self.kv_ip, self.kv_port, derived_key(self.extra("auth_token"), "pipe"),
                          self.extra("pipe_timeout"))

    def grpc_token(self) -> str | None:
        """What gRPC calls carry in their metadata (in the clear, on a plaintext channel)."""
        check_auth_token(self.extra("auth_token"))  # it may have been set since (from the environment)
        return derived_key(self.extra("auth_token"), "grpc")

    @classmethod
    def from_json(cls, text: str) -> "KVTransferConfig":
        """vLLM's JSON, its connector names included (vllm_connectors.py maps them onto pipes and tiers)."""
        fields = parse_json(text)
        if not isinstance(fields, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
        fields, tiers = translate(fields)
        known = set(cls.__dataclass_fields__) - {"tiers"}
        unknown = set(fields) - known
        if unknown:
            raise ValueError(f"--kv-transfer-config has unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
        config = cls(**fields)
        config.tiers = tiers
        return config


def parse_json(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-transfer-config is not valid JSON: {e}") from None
