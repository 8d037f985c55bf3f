"""What a pipe raises (every transport alike)."""


class PipeError(RuntimeError):
    """The pipe cannot carry on: the peer is gone, timed out or spoke nonsense."""


class PipeClosed(PipeError):
    """The peer closed the connection or died."""


class PipeTimeout(PipeError):
    """A send or receive made no progress within the pipe's timeout."""


class NoMessage(PipeTimeout):
    """No message started within the timeout; nothing was consumed, the pipe stays usable."""


class ProtocolError(PipeError):
    """A malformed header, wrong magic or unsupported protocol version."""


class AuthError(PipeError):
    """The peer's shared secret did not match ours."""


class PeerMayWrite(PipeError):
    """A receive into the caller's memory was cut off while the peer's one-sided writes into it
    may still be in flight: that memory must never be reused (the peer neither finished nor closed
    its connection within the drain time)."""
