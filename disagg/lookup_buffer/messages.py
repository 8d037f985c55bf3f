"""What the lookup buffer puts on a pipe, and the token digest that identifies a prompt.

A pipe carries lists of tensors and nothing else (no pickle), so every message starts
with a 1-d uint8 tensor holding a small JSON header; an entry's KV tensors follow it:

    hello  = [header {"kind": "hello", "version", "source": [host, port]}]
    bye    = [header {"kind": "bye", "version"}]: the producer closes this idle connection
    entry  = [header {"kind": "entry", "version", "request_id", "token_digest", "extras", "layers",
                      "tokens", "chunk", "first_token"}],
             then [*kv_tensors] if layers is null,
             else, for each chunk of the prompt's tokens in order, one message [kv of layers
             first..end, the chunk's tokens] for each [first, end] pair of layers; the first chunk
             has `chunk` of the entry's `tokens`, each later one follows a chunk message
             [int64 tensor [its tokens]]; a chunk message of 0 tokens withdraws the entry (it is
             sent again, from its start, later), a None message in place of any cancels it;
             if first_token is true, a last message [header {"token_id", "logprob", "top"}]: the
             prompt's first token, sampled where the KV was computed

A producer sends one hello as the first message of each connection, so the consumer
knows which producer a connection (and its failure) belongs to, and a bye before it closes one
it had nothing to send on, so that the consumer does not take that close for the producer's loss.
An entry's header comes before its KV, so that the consumer knows the request before its KV arrives and can
receive the KV straight into that request's blocks; a layer-wise entry's KV follows in
parts, one per group of layers and chunk of a prompt computed in chunks, sent as the prefill
computes them. The prompt's first token follows its KV on the same connection, so that a decode node
has both without waiting for the prefill node's answer to its Prefill call (docs/ARCHITECTURE.md, "A
request, end to end"). `decode` checks every field's type and size: whatever a peer sends gives a
Hello, a Bye, a KVEntry (its header: no KV yet) or ProtocolError; `decode_first_token` a FirstToken or
ProtocolError.
"""

import hashlib
import json
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from disagg.pipes import wire
from disagg.pipes.errors import ProtocolError

# 2: an entry's header, then its KV in a message of its own; 3: or in layer parts; 4: per chunk too; 5: the
# first token behind the KV, and bye
PROTOCOL_VERSION = 5
MAX_HEADER_BYTES = 64 << 10  # a header is a few hundred bytes
MAX_REQUEST_ID_CHARS = 256  # the decode node's API takes X-Request-Id of at most 128
MAX_HOST_CHARS = 255
MAX_LAYERS = 1024
DIGEST = re.compile(r"[0-9a-f]{64}")  # token_digest's hex sha256
MAX_TOP_LOGPROBS = 20  # a first token's top logprobs: SamplingParams' MAX_LOGPROBS
MAX_TOKEN_ID = 2**31 - 1

Extras = dict[str, int | float | str]


def token_digest(token_ids: list[int] | torch.Tensor) -> str:
    """Hex sha256 of the token ids as int64 little-endian bytes.

    The prefill node returns it to the decode node, and the consumer checks every entry
    against it, so KV computed for other tokens is never used under the same request id.
    """
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-d, got shape {list(token_ids.shape)}")
        ids = token_ids.detach().cpu().numpy().astype("<i8")
    else:
        ids = np.asarray(token_ids, dtype="<i8")
    return hashlib.sha256(ids.tobytes()).hexdigest()


@dataclass
class FirstToken:
    """A prompt's first token, sampled where its KV was computed, with its logprob and the most likely
    tokens' (token id, logprob) when they were asked for."""

    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class KVEntry:
    """One request's KV as it crosses from a producer to a consumer."""

    request_id: str
    token_digest: str
    kv_tensors: list[torch.Tensor]
    extras: Extras = field(default_factory=dict)
    # Layer-wise: its one KV tensor [layers, 2, tokens, kv heads, head dim] travels as a part per
    # [first, end) group of layers, in order from layer 0; None: kv_tensors travel in one message.
    layers: list[tuple[int, int]] | None = None
    tokens: int = 0  # layer-wise: the tokens its KV holds
    chunk: int = 0  # layer-wise: the tokens of its first chunk (all of them unless computed in chunks)
    # The consumer received the KV into the destination its expect() named: kv_tensors are that (its
    # views or RowScatters), not tensors of their own.
    in_place: bool = False
    carries_first_token: bool = False  # layer-wise: the prompt's first token follows its KV
    first_token: FirstToken | None = None  # ... and, once received, is this

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.kv_tensors)


@dataclass
class Hello:
    """First message of a connection: who the producer is."""

    source: tuple[str, int]
    version: int = PROTOCOL_VERSION


@dataclass
class Bye:
    """Last message of a connection its producer closes because it had nothing to send on it."""


def check_extras(extras: Extras) -> None:
    """Extras travel as JSON, so only flat str -> int | float | str maps survive the trip unchanged."""
    for key, value in extras.items():
        if not isinstance(key, str) or not isinstance(value, int | float | str):
            raise TypeError(
                f"extras[{key!r}] = {value!r} ({type(value).__name__}): extras map str to int, float or str only"
            )


def check_request_id(request_id: object) -> None:
    """Request ids key the consumer's entries and appear in its logs: a str of bounded length."""
    if not isinstance(request_id, str):
        raise TypeError(f"request id must be a str, got {type(request_id).__name__}")
    if not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request id must be 1 to {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")


def encode_hello(hello: Hello) -> list[torch.Tensor]:
    return [_header({"kind": "hello", "version": hello.version, "source": list(hello.source)})]


def encode_bye() -> list[torch.Tensor]:
    return [_header({"kind": "bye", "version": PROTOCOL_VERSION})]


def check_tensors(tensors: list[torch.Tensor]) -> None:
    """ProtocolError, before anything is sent, if a KV tensor cannot travel on a pipe."""
    for tensor in tensors:
        wire.TensorMeta.of(tensor)


def encode_entry(entry: KVEntry) -> list[torch.Tensor]:
    """The entry's header message; its KV follows as entry.layers says."""
    header = {
        "kind": "entry",
        "version": PROTOCOL_VERSION,
        "request_id": entry.request_id,
        "token_digest": entry.token_digest,
        "extras": entry.extras,
        "layers": entry.layers,
        "tokens": entry.tokens,
        "chunk": entry.chunk,
        "first_token": entry.carries_first_token,
    }
    return [_header(header)]


def encode_first_token(first: FirstToken) -> list[torch.Tensor]:
    """The message behind the KV of an entry that carries its prompt's first token."""
    return [_header({"token_id": first.token_id, "logprob": first.logprob, "top": [list(t) for t in first.top]})]


def decode_first_token(message: list[torch.Tensor]) -> FirstToken:
    """A first-token message's FirstToken; else ProtocolError."""
    if len(message) != 1:
        raise ProtocolError("a first-token message is its header alone")
    try:
        header = _header_of(message)
        token_id, logprob, top = header["token_id"], header["logprob"], header["top"]
        if not _is_token_id(token_id):
            raise ValueError(f"token_id must be an int from 0 to {MAX_TOKEN_ID}, got {token_id!r:.40}")
        if not (logprob is None or _is_number(logprob)):
            raise ValueError(f"logprob must be a number or null, got {logprob!r:.40}")
        if not isinstance(top, list) or len(top) > MAX_TOP_LOGPROBS or (top and logprob is None):
            raise ValueError(f"top must be a list of at most {MAX_TOP_LOGPROBS} pairs, none without a logprob")
        pairs = []
        for pair in top:
            top_id, top_logprob = pair  # ValueError or TypeError unless a pair
            if not (_is_token_id(top_id) and _is_number(top_logprob)):
                raise ValueError(f"a top logprob must be [token id, logprob], got {pair!r:.80}")
            pairs.append((top_id, float(top_logprob)))
        return FirstToken(token_id, None if logprob is None else float(logprob), pairs)
    except (ValueError, KeyError, TypeError, RecursionError, OverflowError) as e:  # Overflow: a huge JSON int
        raise ProtocolError(f"malformed first-token message: {e!r:.300}") from None


def _header_of(message: list[torch.Tensor] | None) -> object:
    """The JSON value a message's header tensor holds: ProtocolError if it holds no header (or one too
    large to read), ValueError if its bytes are not JSON."""
    if not message or message[0].dtype != torch.uint8 or message[0].dim() != 1 or message[0].is_cuda:
        raise ProtocolError("lookup-buffer message must start with a 1-d uint8 CPU header tensor")
    if message[0].numel() > MAX_HEADER_BYTES:
        raise ProtocolError(f"lookup-buffer header of {message[0].numel()} bytes; at most {MAX_HEADER_BYTES}")
    return json.loads(message[0].numpy().tobytes())


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID


def _is_number(value: object) -> bool:
    """A JSON number (-Infinity and NaN too, as a model's logprob may be: its value is the model's business)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def encode_chunk(tokens: int) -> list[torch.Tensor]:
    """The message before each later chunk of a layer-wise entry: how many tokens it holds; 0
    withdraws the entry (the receiver drops what it got; the entry comes again, from its start)."""
    return [torch.tensor([tokens], dtype=torch.int64)]


def decode_chunk(message: list[torch.Tensor], tokens_left: int) -> int:
    """A chunk message's tokens, 0 (withdrawn) to `tokens_left`; else ProtocolError."""
    if len(message) != 1 or message[0].dtype != torch.int64 or message[0].shape != (1,) or message[0].is_cuda:
        raise ProtocolError("a chunk message is one int64 CPU tensor of one element")
    tokens = int(message[0])
    if not 0 <= tokens <= tokens_left:
        raise ProtocolError(f"a chunk of {tokens} tokens; 0 to {tokens_left} were left")
    return tokens


def decode(message: list[torch.Tensor] | None) -> Hello | Bye | KVEntry:
    """Parse a received message; ProtocolError names what was wrong with it."""
    try:
        header = _header_of(message)
        if not isinstance(header, dict):
            raise TypeError(f"the header must be a JSON object, got {type(header).__name__}")
        kind, version = header["kind"], header["version"]
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"peer speaks lookup-buffer protocol version {version!r:.20}, we speak {PROTOCOL_VERSION}: "
                "run the same disagg version on prefill and decode nodes"
            )
        if kind == "hello":
            return Hello(source=_source(header["source"]), version=version)
        if kind == "bye":
            if len(message) != 1:
                raise ProtocolError("a bye comes alone")
            return Bye()
        if kind == "entry":
            if len(message) != 1:
                raise ProtocolError("an entry's header comes alone: its KV follows in a message of its own")
            request_id, digest, extras = header["request_id"], header["token_digest"], header["extras"]
            check_request_id(request_id)
            if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
                raise ValueError(f"token_digest must be 64 lowercase hex digits, got {digest!r:.80}")
            if not isinstance(extras, dict):
                raise TypeError(f"extras must be a map, got {type(extras).__name__}")
            check_extras(extras)
            entry = KVEntry(request_id, digest, [], extras, _layers(header["layers"]))
            if entry.layers is not None:
                entry.tokens, entry.chunk = _chunk(header["tokens"], header["chunk"])
            entry.carries_first_token = header["first_token"]
            if not isinstance(entry.carries_first_token, bool) or (entry.carries_first_token and entry.layers is None):
                raise ValueError("first_token must be a bool, true only for a layer-wise entry")
            return entry
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: deeply nested JSON
        raise ProtocolError(f"malformed lookup-buffer header: {e!r:.300}") from None
    raise ProtocolError(f"unknown lookup-buffer message kind {kind!r:.40}")


def _layers(value: object) -> list[tuple[int, int]] | None:
    """Layer groups [first, end) that follow each other from layer 0, or None."""
    if value is None:
        return None
    if not isinstance(value, list) or not 0 < len(value) <= MAX_LAYERS:
        raise ValueError(f"layers must be a list of 1 to {MAX_LAYERS} [first, end] pairs")
    groups, end = [], 0
    for pair in value:
        first, last = pair  # ValueError or TypeError unless a pair
        if not (isinstance(first, int) and isinstance(last, int) and first == end < last <= MAX_LAYERS):
            raise ValueError(f"layer groups must follow each other from layer 0, got {value!r:.200}")
        groups.append((first, last))
        end = last
    return groups


def _chunk(tokens: object, chunk: object) -> tuple[int, int]:
    """A layer-wise entry's tokens and its first chunk's: 0 < chunk <= tokens."""
    if not (isinstance(tokens, int) and isinstance(chunk, int) and 0 < chunk <= tokens):
        raise ValueError(f"an entry of {tokens!r:.20} tokens cannot have a first chunk of {chunk!r:.20}")
    return tokens, chunk


def _source(value: object) -> tuple[str, int]:
    host, port = value  # ValueError or TypeError unless a pair
    if not isinstance(host, str) or len(host) > MAX_HOST_CHARS:
        raise ValueError(f"source host must be a str of at most {MAX_HOST_CHARS} characters, got {host!r:.80}")
    if not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(f"source port must be a port number, got {port!r:.20}")
    return host, port


def _header(obj: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
