"""Messages of the control plane between decode and prefill nodes, as plain dataclasses.

`proto/disagg.proto` is the wire contract; these are what the nodes pass around in-process,
converted to and from protobuf at the gRPC boundary only.
"""

from dataclasses import dataclass, field, fields

from disagg.engine.sampling_params import SamplingParams

# 2: Prefill streams progress; penalties, logit_bias and min_tokens in SamplingFields. 3: Watch (a decode
# node follows each prefill node's load and prefix cache); progress tells of a long step in progress.
# 4: a decode node's ranks each receive their KV heads (kv_ranks). 5: a prefill node's ranks each send their
# own KV heads (NodeInfo.kv_rank_heads; entry ids from plan_entries). 6: the Prefill answer carries no first
# token nor digest (the first token follows the KV on the pipe; the digest is in the entry's header).
PROTOCOL_VERSION = 6
# Fields two nodes must agree on before KV can move between them.
COMPATIBILITY_FIELDS = ("protocol_version", "model_name", "dtype", "num_layers", "num_kv_heads",
                        "head_dim", "block_size", "kv_connector")


@dataclass
class NodeInfo:
    model_name: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_connector: str  # the pipe both ends must speak
    kv_ip: str  # this node's own pipe endpoint
    kv_port: int
    protocol_version: int = PROTOCOL_VERSION
    # Each tensor-parallel rank's KV heads [first, end), rank 0's first (one rank: all of them): a decode
    # node plans from these which of this node's ranks sends it which heads (plan_entries).
    kv_rank_heads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def heads_by_rank(self) -> list[tuple[int, int]]:
        """kv_rank_heads, or one rank's, all the heads, where it was left empty."""
        return self.kv_rank_heads or [(0, self.num_kv_heads)]

    def mismatch(self, other: "NodeInfo") -> str | None:
        """The first compatibility field that differs, described for an error message."""
        for name in COMPATIBILITY_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} differs: this node has {mine!r}, the peer has {theirs!r}"
        return None


@dataclass(frozen=True)
class KVRank:
    """One decode rank's pipe endpoint and the KV heads [first, end) its cache holds."""
    dest: tuple[str, int]
    heads: tuple[int, int]


def rank_entry_id(request_id: str, rank: int) -> str:
    """The lookup-buffer entry that carries rank `rank`'s KV heads of a request: rank 0's is the
    request's own id, so a decode node without tensor parallelism sees no difference."""
    return request_id if rank == 0 else f"{request_id}.{rank}"


@dataclass(frozen=True)
class HeadsEntry:
    """One lookup-buffer entry of a request's KV: prefill rank `prefill_rank`'s KV heads [first, end)
    for decode rank `decode_rank`."""
    entry_id: str
    decode_rank: int
    prefill_rank: int
    heads: tuple[int, int]


def plan_entries(request_id: str, decode_heads: list[tuple[int, int]],
                 prefill_heads: list[tuple[int, int]]) -> list[HeadsEntry]:
    """Which prefill rank sends which KV heads to which decode rank (each rank's heads [first, end),
    rank 0's first): one entry per pair of ranks whose heads overlap. A head that several prefill ranks
    hold (replicated: fewer KV heads than ranks) is sent once, by the lowest of them. Both nodes compute
    this, so the decode node knows which entries to expect. With one prefill rank the entry ids are
    rank_entry_id's, as before prefill ranks sent their own."""
    entries, covered = [], 0  # heads below `covered` are a lower prefill rank's to send
    for p, (first, end) in enumerate(prefill_heads):
        first, covered = max(first, covered), max(covered, end)  # the shard plan's runs go up with the rank
        for d, (decode_first, decode_end) in enumerate(decode_heads):
            lo, hi = max(first, decode_first), min(end, decode_end)
            if lo < hi:
                entry_id = rank_entry_id(request_id, d) if len(prefill_heads) == 1 else f"{request_id}.r{d}.p{p}"
                entries.append(HeadsEntry(entry_id, d, p, (lo, hi)))
    return entries


@dataclass
class PrefillCall:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # the first token is sampled with these
    kv_dest: tuple[str, int]  # the decode node's pipe endpoint: where the KV goes
    skip_tokens: int = 0  # leading prompt tokens whose KV the decode node already holds: not sent
    # A hint: the prefill node at this gRPC address holds the prompt's first pull_blocks full blocks
    # (prefill_node/pull.py); "": none does.
    pull_from: str = ""
    pull_blocks: int = 0
    # Each decode rank's endpoint and heads (rank 0's dest is kv_dest): each gets only its heads, as
    # an entry of its own (rank_entry_id). Empty: every KV head goes to kv_dest.
    kv_ranks: list[KVRank] = field(default_factory=list)


@dataclass
class PrefillResult:
    """What a Prefill call answers once all its KV is queued in the producer (the first token behind it)."""

    num_cached_tokens: int  # prompt tokens the prefill node's prefix cache already had
    kv_bytes: int
    prefill_seconds: float


@dataclass(frozen=True)
class PrefillProgress:
    engine_steps: int  # steps the prefill node's engine has run, for any request
    num_computed_tokens: int  # of this prompt; 0 while it waits in the node's queue
    step_seconds: float = 0.0  # how long the step running now has run; 0: none is running
    step_expected_seconds: float = 0.0  # how long that step should take by the measured cost; 0: not measured


@dataclass(frozen=True)
class NodeLoad:
    """A prefill node's load, as its Watch stream reports it."""
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens of the requests it holds, still to compute
    prefill_tokens_per_s: float = 0.0  # measured from its engine's steps; 0: not measured yet
    step_base_seconds: float = 0.0  # what a step costs it beyond its prompt tokens (engine/step_cost.py)


def sampling_fields(params: SamplingParams) -> dict:
    """What a prefill node needs of the sampling params to pick the first token."""
    return {f.name: getattr(params, f.name) for f in fields(SamplingParams) if f.name in FIRST_TOKEN_FIELDS}


FIRST_TOKEN_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids",
                      "ignore_eos", "structured")
