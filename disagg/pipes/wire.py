"""The pipe wire format and handshake, shared by every transport. No pickle.

A message is a fixed header, a metadata block (one entry per tensor), then the raw
tensor bytes in order:

    header   = magic(4s) version(H) kind(B) pad(x) count(I) meta_nbytes(I)
    entry    = dtype_code(B) ndim(B) dims(ndim x Q) nbytes(Q)

The handshake runs once per connection, both sides at the same time:

    hello    = magic(4s) version(H) has_token(B) nonce(16s)
    proof    = HMAC-SHA256(auth_token, role + peer's nonce)

Each side checks the peer's hello and proof itself, so both ends learn why a
connection was refused.

The decoders trust nothing they parse: any bytes in give a header and metadata whose
tensors can be allocated within the receiver's max_message_bytes, or ProtocolError.
"""

import enum
import hashlib
import hmac
import math
import os
import struct
from collections.abc import Callable
from typing import NamedTuple

import torch

from disagg.pipes.errors import AuthError, PipeClosed, ProtocolError
from disagg.pipes.row_scatter import RowScatter

MAGIC = b"DKV1"
PROTOCOL_VERSION = 2

MAX_TENSORS = 1 << 16
MAX_NDIM = 8

HEADER = struct.Struct("!4sHBxII")
ENTRY_HEAD = struct.Struct("!BB")
# One struct per rank: a message's metadata is packed and parsed on every send and recv.
ENTRY_DIMS = [struct.Struct(f"!{ndim}QQ") for ndim in range(MAX_NDIM + 1)]
ENTRY = [struct.Struct(f"!BB{ndim}QQ") for ndim in range(MAX_NDIM + 1)]
HELLO = struct.Struct("!4sHB16s")
PROOF_NBYTES = 32

# Wire codes are fixed forever: never renumber, only append.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int8: 5,
    torch.int16: 6,
    torch.int32: 7,
    torch.int64: 8,
    torch.uint8: 9,
    torch.bool: 10,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class Kind(enum.IntEnum):
    TENSORS = 1
    NONE = 2  # the message is `None`
    CLOSE = 3  # the sender closed the pipe cleanly


KINDS = {kind.value: kind for kind in Kind}


class TensorMeta(NamedTuple):  # a NamedTuple: built for every tensor of every message
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorMeta":
        if tensor.dtype not in DTYPE_CODES:
            raise ProtocolError(
                f"cannot send dtype {tensor.dtype}; supported: {', '.join(str(d) for d in DTYPE_CODES)}"
            )
        if tensor.dim() > MAX_NDIM:
            raise ProtocolError(
                f"cannot send a {tensor.dim()}-d tensor; at most {MAX_NDIM} dims"
            )
        return cls(tensor.dtype, tuple(tensor.shape))


class Header(NamedTuple):
    kind: Kind
    count: int
    meta_nbytes: int


def encode(kind: Kind, metas: list[TensorMeta] = ()) -> bytes:
    """Header + metadata block for one message."""
    meta = b"".join(
        ENTRY[len(m.shape)].pack(DTYPE_CODES[m.dtype], len(m.shape), *m.shape, m.nbytes)
        for m in metas
    )
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, kind, len(metas), len(meta)) + meta


def decode_header(buf: bytes) -> Header:
    if len(buf) != HEADER.size:
        raise ProtocolError(f"a message header is {HEADER.size} bytes, got {len(buf)}")
    magic, version, kind, count, meta_nbytes = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(
            f"bad magic {magic!r} (expected {MAGIC!r}): the peer is not a disagg pipe"
        )
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"peer sent protocol version {version}, we speak {PROTOCOL_VERSION}"
        )
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind}")
    if count > MAX_TENSORS:
        raise ProtocolError(f"message claims {count} tensors; at most {MAX_TENSORS}")
    if meta_nbytes > count * ENTRY[MAX_NDIM].size:
        raise ProtocolError(
            f"metadata block of {meta_nbytes} bytes is too large for {count} tensors"
        )
    if kind != Kind.TENSORS and (count or meta_nbytes):
        raise ProtocolError(
            f"a {KINDS[kind].name} message carries no tensors, got {count}"
        )
    return Header(KINDS[kind], count, meta_nbytes)


def decode_meta(buf: bytes, count: int, max_bytes: int) -> list[TensorMeta]:
    """The metadata block of `count` tensors, refused unless their bytes fit in `max_bytes`:
    the receiver allocates what a header claims before any of it arrives."""
    metas, offset, total = [], 0, 0
    try:
        for i in range(count):
            code, ndim = ENTRY_HEAD.unpack_from(buf, offset)
            if code not in CODE_DTYPES:
                raise ProtocolError(f"tensor {i}: unknown dtype code {code}")
            if ndim > MAX_NDIM:
                raise ProtocolError(f"tensor {i}: {ndim} dims; at most {MAX_NDIM}")
            *shape, nbytes = ENTRY_DIMS[ndim].unpack_from(buf, offset + 2)
            offset += ENTRY[ndim].size
            meta = TensorMeta(CODE_DTYPES[code], tuple(shape))
            if nbytes != meta.nbytes:
                raise ProtocolError(
                    f"tensor {i}: {nbytes} bytes does not match shape {meta.shape} of {meta.dtype}"
                )
            # An empty tensor's other dims still reach torch, which computes strides from them.
            if nbytes == 0 and math.prod(d or 1 for d in shape) * meta.dtype.itemsize > max_bytes:
                raise ProtocolError(f"tensor {i}: shape {meta.shape} has dims too large to allocate")
            total += nbytes
            if total > max_bytes:
                raise ProtocolError(
                    f"message larger than {max_bytes} bytes (tensor {i}: {meta.dtype}{list(meta.shape)}), "
                    "the receiver's max_message_bytes; raise it on the receiving side if such messages are expected"
                )
            metas.append(meta)
    except struct.error as e:
        raise ProtocolError(f"truncated metadata block: {e}") from None
    if offset != len(buf):
        raise ProtocolError(f"metadata block has {len(buf) - offset} trailing bytes")
    return metas


def check_out(out: list, metas: list[TensorMeta]) -> None:
    """`recv(out=...)` must match the message exactly: each destination a tensor (or RowScatter) of
    the same dtype and shape, or contiguous views of that dtype holding as many elements in all."""
    if len(out) != len(metas):
        raise ProtocolError(f"message has {len(metas)} tensors but out has {len(out)}")
    for i, (dest, m) in enumerate(zip(out, metas)):
        if isinstance(dest, torch.Tensor | RowScatter):
            if dest.dtype != m.dtype or tuple(dest.shape) != m.shape:
                raise ProtocolError(
                    f"tensor {i}: message has {m.dtype}{list(m.shape)}, out has {dest.dtype}{list(dest.shape)}"
                )
            continue
        numel = sum(view.numel() for view in dest)
        if any(view.dtype != m.dtype or not view.is_contiguous() for view in dest) or numel != math.prod(m.shape):
            raise ProtocolError(
                f"tensor {i}: message has {m.dtype}{list(m.shape)}, out has {len(dest)} views of "
                f"{numel} elements in all (each must be contiguous and of that dtype)"
            )


def message_metas(kind: Kind, metas: list[TensorMeta], out: list | None) -> list[TensorMeta] | None:
    """What a received message carries: its tensors' metadata (checked against `out`), None
    for a None message; PipeClosed if the peer closed the pipe."""
    if kind == Kind.CLOSE:
        raise PipeClosed("the peer closed the pipe")
    if kind == Kind.NONE:
        return None
    if out is not None:
        check_out(out, metas)
    return metas


def handshake(
    send: Callable[[bytes], None],
    recv_exact: Callable[[int], bytes],
    auth_token: str | None,
    is_listener: bool,
) -> None:
    """Run the connection handshake; raises ProtocolError or AuthError on a bad peer."""
    if auth_token == "":  # an HMAC keyed with nothing proves nothing: auth would be on in name only
        raise AuthError("kv_auth_token is empty; give a secret, or None for no auth")
    nonce = os.urandom(16)
    send(HELLO.pack(MAGIC, PROTOCOL_VERSION, auth_token is not None, nonce))
    magic, version, peer_has_token, peer_nonce = HELLO.unpack(recv_exact(HELLO.size))
    if magic != MAGIC:
        raise ProtocolError(
            f"bad magic {magic!r} (expected {MAGIC!r}): the peer is not a disagg pipe"
        )
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"peer speaks pipe protocol version {version}, we speak {PROTOCOL_VERSION}"
        )
    # The role goes into the MAC so a proof cannot be reflected back to its sender.
    send(_proof(auth_token, b"L" if is_listener else b"C", peer_nonce))
    peer_proof = recv_exact(PROOF_NBYTES)
    if bool(peer_has_token) != (auth_token is not None):
        ours, theirs = ("set", "unset") if auth_token is not None else ("unset", "set")
        raise AuthError(
            f"kv_auth_token mismatch: ours is {ours}, the peer's is {theirs}; set the same token on both"
        )
    if not hmac.compare_digest(
        peer_proof, _proof(auth_token, b"C" if is_listener else b"L", nonce)
    ):
        raise AuthError(
            "kv_auth_token mismatch: the peer uses a different token; set the same token on both"
        )


def _proof(auth_token: str | None, role: bytes, nonce: bytes) -> bytes:
    return hmac.new((auth_token or "").encode(), role + nonce, hashlib.sha256).digest()
