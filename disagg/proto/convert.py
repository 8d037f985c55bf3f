"""Control-plane dataclasses <-> protobuf messages, one pair of functions per message.

Only the gRPC boundary (prefill_node/service.py, decode_node/prefill_client.py) calls these;
everything else passes the dataclasses of disagg/control_plane.py.
"""

from dataclasses import asdict

from disagg.control_plane import (
    KVRank,
    NodeInfo,
    NodeLoad,
    PrefillCall,
    PrefillProgress,
    PrefillResult,
    sampling_fields,
)
from disagg.engine.kv_events import KVEventBatch, KVSnapshot
from disagg.engine.sampling_params import SamplingParams, StructuredOutputSpec
from disagg.proto import disagg_pb2 as pb


def node_info_to_proto(info: NodeInfo) -> pb.NodeInfo:
    fields = asdict(info)
    fields["kv_rank_heads"] = [pb.HeadRange(first_head=first, end_head=end) for first, end in info.kv_rank_heads]
    return pb.NodeInfo(**fields)


def node_info_from_proto(msg: pb.NodeInfo) -> NodeInfo:
    return NodeInfo(model_name=msg.model_name, dtype=msg.dtype, num_layers=msg.num_layers,
                    num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim, block_size=msg.block_size,
                    kv_connector=msg.kv_connector, kv_ip=msg.kv_ip, kv_port=msg.kv_port,
                    protocol_version=msg.protocol_version,
                    kv_rank_heads=[(h.first_head, h.end_head) for h in msg.kv_rank_heads])


def prefill_call_to_proto(call: PrefillCall) -> pb.PrefillRequest:
    host, port = call.kv_dest
    # Fields left None stay unset: the receiver reads them back as None.
    sampling = {k: v for k, v in sampling_fields(call.params).items() if v is not None}
    if "structured" in sampling:
        spec = sampling["structured"]
        sampling["structured"] = pb.StructuredOutput(kind=spec.kind, value=spec.value, after_tokens=spec.after_tokens)
    return pb.PrefillRequest(request_id=call.request_id, prompt_token_ids=call.prompt_token_ids,
                             sampling=pb.SamplingFields(**sampling), kv_dest_host=host, kv_dest_port=port,
                             skip_tokens=call.skip_tokens, pull_from=call.pull_from, pull_blocks=call.pull_blocks,
                             kv_ranks=[pb.KVRank(host=r.dest[0], port=r.dest[1], first_head=r.heads[0],
                                                 end_head=r.heads[1]) for r in call.kv_ranks])


def prefill_call_from_proto(msg: pb.PrefillRequest) -> PrefillCall:
    """Raises ValueError when the sampling fields (SamplingParams checks them) or skip_tokens are out of range."""
    s = msg.sampling
    params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                            seed=s.seed if s.HasField("seed") else None,
                            logprobs=s.logprobs if s.HasField("logprobs") else None,
                            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                            repetition_penalty=s.repetition_penalty or 1.0,  # unset: an older sender's 0
                            logit_bias=dict(s.logit_bias), min_tokens=min(s.min_tokens, 1),
                            stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos, max_tokens=1,
                            structured=StructuredOutputSpec(s.structured.kind, s.structured.value,
                                                            tuple(s.structured.after_tokens))
                            if s.HasField("structured") else None)
    if not 0 <= msg.skip_tokens < len(msg.prompt_token_ids):
        raise ValueError(
            f"skip_tokens must be in [0, prompt length {len(msg.prompt_token_ids)}), got {msg.skip_tokens}")
    if msg.pull_blocks < 0:
        raise ValueError(f"pull_blocks must be 0 or more, got {msg.pull_blocks}")
    kv_ranks = [KVRank((r.host, r.port), (r.first_head, r.end_head)) for r in msg.kv_ranks]
    if kv_ranks and kv_ranks[0].dest != (msg.kv_dest_host, msg.kv_dest_port):
        raise ValueError("kv_ranks must start with kv_dest's (rank 0's)")
    return PrefillCall(request_id=msg.request_id, prompt_token_ids=list(msg.prompt_token_ids), params=params,
                       kv_dest=(msg.kv_dest_host, msg.kv_dest_port), skip_tokens=msg.skip_tokens,
                       pull_from=msg.pull_from, pull_blocks=msg.pull_blocks, kv_ranks=kv_ranks)


def prefill_result_to_proto(result: PrefillResult) -> pb.PrefillReply:
    return pb.PrefillReply(num_cached_tokens=result.num_cached_tokens, kv_bytes=result.kv_bytes,
                           prefill_seconds=result.prefill_seconds)


def prefill_result_from_proto(msg: pb.PrefillReply) -> PrefillResult:
    return PrefillResult(num_cached_tokens=msg.num_cached_tokens, kv_bytes=msg.kv_bytes,
                         prefill_seconds=msg.prefill_seconds)


def progress_to_proto(progress: PrefillProgress) -> pb.PrefillUpdate:
    return pb.PrefillUpdate(progress=pb.PrefillProgress(**asdict(progress)))


def progress_from_proto(msg: pb.PrefillProgress) -> PrefillProgress:
    return PrefillProgress(engine_steps=msg.engine_steps, num_computed_tokens=msg.num_computed_tokens,
                           step_seconds=msg.step_seconds, step_expected_seconds=msg.step_expected_seconds)


def node_state_to_proto(load: NodeLoad, snapshot: KVSnapshot | None = None,
                        events: KVEventBatch | None = None) -> pb.NodeState:
    msg = pb.NodeState(load=pb.NodeLoad(**asdict(load)))
    if snapshot is not None:
        tiers = [pb.TierHashes(medium=medium, hashes=held) for medium, held in snapshot.hashes.items()]
        msg.snapshot.CopyFrom(pb.KVSnapshot(seq=snapshot.seq, block_size=snapshot.block_size, tiers=tiers))
    if events is not None:
        msg.events.CopyFrom(pb.KVEventBatch(seq=events.seq, medium=events.medium, stored=events.stored,
                                            removed=events.removed))
    return msg


def node_state_from_proto(msg: pb.NodeState) -> tuple[NodeLoad, KVSnapshot | None, KVEventBatch | None]:
    load = msg.load
    snapshot = events = None
    if msg.HasField("snapshot"):
        snapshot = KVSnapshot(msg.snapshot.seq, msg.snapshot.block_size,
                              {tier.medium: list(tier.hashes) for tier in msg.snapshot.tiers})
    if msg.HasField("events"):
        events = KVEventBatch(msg.events.seq, msg.events.medium, list(msg.events.stored), list(msg.events.removed))
    return NodeLoad(load.num_running, load.num_waiting, load.queued_prefill_tokens, load.prefill_tokens_per_s,
                    load.step_base_seconds), snapshot, events
