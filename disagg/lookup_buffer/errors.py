"""Why a lookup-buffer call failed, one class per thing the caller reacts to differently."""


class LookupBufferError(RuntimeError):
    """Base of every lookup-buffer error; also raised by calls on a closed buffer."""


class BufferFullError(LookupBufferError):
    """The producer's buffer stayed full for `insert_timeout` (the caller answers RESOURCE_EXHAUSTED),
    or the entry reached a consumer whose buffer was full of unclaimed entries and was dropped."""


class LookupTimeout(LookupBufferError, TimeoutError):
    """No entry for the request arrived within the lookup's timeout."""


class DigestMismatch(LookupBufferError):
    """The entry's token digest is not the digest of the tokens the consumer asked for."""


class ProducerLost(LookupBufferError):
    """The producer a lookup waited on dropped its connection before the entry arrived."""


class LookupDiscarded(LookupBufferError):
    """`discard()` was called for the request while a lookup waited for it."""


class EntryCancelled(LookupBufferError):
    """The producer cancelled the entry after its first parts were sent (its prefill failed)."""
