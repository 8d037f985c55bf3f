"""LookupBuffer: prefill nodes insert finished KV (non-blocking, bounded); decode nodes
claim it by request id (blocking, with a timeout), verified by a digest of the prompt tokens.

    consumer = LookupBufferConsumer("tcp", PipeConfig(kv_ip=..., kv_port=...))   # decode node
    producer = LookupBufferProducer("tcp", config, kv_buffer_size, ttl, insert_timeout)  # prefill node
    producer.insert(request_id, token_ids, kv_tensors, extras, dest=consumer.address)
    entry = consumer.drop_select(request_id, token_ids, timeout)
"""

from disagg.lookup_buffer.consumer import ConsumerStats, LookupBufferConsumer
from disagg.lookup_buffer.errors import (
    BufferFullError,
    DigestMismatch,
    EntryCancelled,
    LookupBufferError,
    LookupDiscarded,
    LookupTimeout,
    ProducerLost,
)
from disagg.lookup_buffer.messages import FirstToken, KVEntry, token_digest
from disagg.lookup_buffer.producer import LookupBufferProducer, ProducerStats

__all__ = [
    "BufferFullError",
    "ConsumerStats",
    "DigestMismatch",
    "EntryCancelled",
    "FirstToken",
    "KVEntry",
    "LookupBufferConsumer",
    "LookupBufferError",
    "LookupBufferProducer",
    "LookupDiscarded",
    "LookupTimeout",
    "ProducerLost",
    "ProducerStats",
    "token_digest",
]
