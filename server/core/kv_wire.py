"""The KV transfer wire format between a prefill and a decode server. Pure Python, no torch.

One body per request (per prompt)::

    b"LLMFKV" | version: u16 LE | header length: u32 LE | header (UTF-8 JSON) | payload | MAC

The MAC is HMAC-SHA256 over everything before it, keyed by the fleet's transfer token
(LLMFLEET_KV_TRANSFER_TOKEN), which only the fleet's own servers hold: a body anyone else made or
altered is refused before a byte of it is trusted, so forged KV never reaches a cache that other
clients' requests read. (A CRC32 alone, which a forger recomputes, let it in.) Without a token
(``--insecure-kv-transfer``) the key is a constant: the MAC then only catches corruption.

The header names everything the receiver must agree with before it writes a single byte into its
cache: the model (served name and a fingerprint of its weights), dtype, layers, KV heads, head
dim and block size, plus how many prompt tokens the KV covers, a checksum of those token ids (the
receiver tokenized the prompt itself: a tokenizer mismatch must not pass), the first block sent
and a checksum of the payload.

The payload is the request's KV blocks from ``first_block`` on, block-major as the paged cache
holds them: ``(num_layers, 2 [keys, values], num_kv_heads, num_blocks - first_block, block_size *
head_dim)`` in ``dtype``. The blocks before ``first_block`` are left out because the receiver
holds them already, in its prefix cache: a shared system prompt, or an earlier turn of the same
conversation. The last block is only partly filled; the receiver overwrites the rest as it decodes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import zlib
from array import array
from dataclasses import asdict, dataclass

MAGIC = b"LLMFKV"
VERSION = 3  # 2: first_block (a body may leave out the blocks the receiver has cached); 3: the MAC
_PREFIX = struct.Struct("<6sHI")  # magic, version, header length
MAX_HEADER_BYTES = 64 * 1024
PAYLOAD_ALIGN = 64  # the payload starts at a multiple of this offset, so it can be viewed as floats

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
MAC_BYTES = 32  # HMAC-SHA256
UNKEYED = b"llmfleet-kv-transfer-without-a-token"  # the key of --insecure-kv-transfer: no secret


class KVMismatchError(ValueError):
    """The KV body does not fit this server (other model, layout or prompt): answer 4xx."""


class KVCorruptError(ValueError):
    """The KV body is malformed or its checksum fails: answer 4xx, never write it."""


class KVForgedError(KVCorruptError):
    """The KV body's MAC fails: not made by a holder of the transfer token, or altered since."""


def kv_key(token: str | None) -> bytes:
    """The MAC key of a fleet's transfer token (None: the constant of ``--insecure-kv-transfer``)."""
    return UNKEYED if token is None else token.encode()


def body_mac(key: bytes, *parts: bytes | memoryview) -> bytes:
    """HMAC-SHA256 of the body's ``parts`` (prefix and header, then the payload), in order."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


@dataclass(frozen=True)
class KVLayout:
    """How a server's paged KV cache is shaped; both ends of a transfer must have the same."""

    fingerprint: str  # the model's weights and architecture (runner.kv_layout)
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in the payload: keys and values of every layer and KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * ITEMSIZE[self.dtype]

    def num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def payload_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """The payload of ``num_blocks`` blocks as a tensor: (layers, 2, kv_heads, blocks,
        block_size * head_dim), keys then values."""
        return (self.num_layers, 2, self.num_kv_heads, num_blocks, self.block_size * self.head_dim)

    def full_blocks(self, num_tokens: int) -> int:
        """The blocks ``num_tokens`` fill: the ones a receiver can hold cached and a body leave out."""
        return num_tokens // self.block_size


@dataclass(frozen=True)
class KVHeader:
    model: str  # the served model name
    layout: KVLayout
    num_tokens: int  # prompt tokens the KV covers (positions 0 .. num_tokens - 1)
    tokens_crc32: int
    payload_bytes: int
    payload_crc32: int
    first_block: int = 0  # the payload's first block: the ones before it stayed with the receiver

    def to_json(self) -> bytes:
        fields = asdict(self)
        fields.update(fields.pop("layout"))
        return json.dumps({"version": VERSION, **fields}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> KVHeader:
        try:
            fields = json.loads(raw)
            if not isinstance(fields, dict):
                raise TypeError(f"a JSON object expected, got {type(fields).__name__}")
            layout = KVLayout(**{name: fields.pop(name) for name in KVLayout.__dataclass_fields__})
            fields.pop("version", None)
            header = cls(layout=layout, **fields)
        except (ValueError, TypeError, KeyError) as exc:
            raise KVCorruptError(f"unreadable KV header: {exc}") from exc
        if layout.dtype not in ITEMSIZE:
            raise KVCorruptError(f"unknown KV dtype {layout.dtype!r}")
        return header


def tokens_crc32(token_ids: list[int]) -> int:
    return zlib.crc32(array("I", token_ids).tobytes())


def payload_bytes(layout: KVLayout, num_tokens: int, first_block: int = 0) -> int:
    """Bytes of the KV of ``num_tokens`` tokens, from block ``first_block`` on."""
    return (layout.num_blocks(num_tokens) - first_block) * layout.block_bytes


def max_body_bytes(layout: KVLayout, num_tokens: int, first_block: int = 0) -> int:
    """The most bytes a body for ``num_tokens`` tokens from ``first_block`` on can have here: a
    receiver reads no further (a longer body is another layout's, or corrupt)."""
    return _PREFIX.size + MAX_HEADER_BYTES + payload_bytes(layout, num_tokens, first_block) + MAC_BYTES


def leave_out_blocks(payload: memoryview, layout: KVLayout, num_tokens: int, first_block: int) -> memoryview:
    """``payload`` (the KV of ``num_tokens`` tokens) without its first ``first_block`` blocks. The
    blocks are the layout's second-innermost axis, so this copies what is kept."""
    if first_block == 0:
        return payload
    rows = 2 * layout.num_layers * layout.num_kv_heads  # keys and values of each layer and head
    block = layout.block_bytes // rows
    row, skip = layout.num_blocks(num_tokens) * block, first_block * block
    flat = payload.cast("B")
    return memoryview(b"".join(flat[r * row + skip : (r + 1) * row] for r in range(rows)))


def encode_header(
    model: str, layout: KVLayout, token_ids: list[int], payload: memoryview, first_block: int = 0
) -> bytes:
    """The prefix and header for ``payload`` (the KV of ``token_ids`` from block ``first_block``
    on); the payload follows it."""
    if not 0 <= first_block <= layout.full_blocks(len(token_ids)):
        raise ValueError(f"first block {first_block} is not one of the {len(token_ids)} tokens' full blocks")
    expected = payload_bytes(layout, len(token_ids), first_block)
    if payload.nbytes != expected:
        raise ValueError(f"payload has {payload.nbytes} bytes, the layout needs {expected}")
    crc = zlib.crc32(payload)
    header = KVHeader(model, layout, len(token_ids), tokens_crc32(token_ids), payload.nbytes, crc, first_block)
    raw = header.to_json()
    raw += b" " * (-(_PREFIX.size + len(raw)) % PAYLOAD_ALIGN)  # JSON ignores trailing blanks
    return _PREFIX.pack(MAGIC, VERSION, len(raw)) + raw


def decode(
    body: bytes | bytearray | memoryview,
    model: str,
    layout: KVLayout,
    token_ids: list[int],
    first_block: int = 0,
    key: bytes = UNKEYED,
) -> memoryview:
    """Check a received body's MAC (``key``: ``kv_key`` of the fleet's token), then the body
    against this server, the prompt it will serve and the first block it asked for; return the
    payload.

    Raises KVForgedError (the MAC fails), KVCorruptError (malformed, truncated, checksum) or
    KVMismatchError (another model, layout or prompt), each with a message that says what differs."""
    signed = memoryview(body)
    if signed.nbytes < _PREFIX.size + MAC_BYTES:
        raise KVCorruptError(f"KV body too short ({signed.nbytes} bytes)")
    view, mac = signed[:-MAC_BYTES], signed[-MAC_BYTES:]
    _check_prefix(view)  # before the MAC: an older sender's body has none
    if not hmac.compare_digest(body_mac(key, view), mac):
        raise KVForgedError("KV body fails its MAC: not made with this fleet's transfer token, or altered")
    header, payload = _header(view)
    check_header(header, model, layout, token_ids)
    if header.first_block != first_block:
        raise KVCorruptError(f"KV starts at block {header.first_block}; block {first_block} was asked for")
    if payload.nbytes != header.payload_bytes:
        raise KVCorruptError(f"KV payload has {payload.nbytes} bytes, the header says {header.payload_bytes}")
    if zlib.crc32(payload) != header.payload_crc32:
        raise KVCorruptError("KV payload checksum mismatch: the transfer was corrupted")
    return payload


def why_it_does_not_fit(
    start: bytes | bytearray | memoryview, model: str, layout: KVLayout, token_ids: list[int]
) -> None:
    """Raise KVMismatchError where the first bytes of a body too long to take (``start``) show
    another model's or layout's header: the 409 that names the difference, not a bare refusal.
    Nothing of it is used."""
    view = memoryview(start)
    try:
        _check_prefix(view)
        header, _ = _header(view)
    except KVCorruptError:
        return
    check_header(header, model, layout, token_ids)


def _check_prefix(view: memoryview) -> None:
    magic, version, _ = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise KVCorruptError("not a KV transfer body (bad magic)")
    if version != VERSION:
        raise KVMismatchError(f"KV format version {version}; this server reads version {VERSION}")


def _header(view: memoryview) -> tuple[KVHeader, memoryview]:
    """The body's header, and the payload after it."""
    header_len = _PREFIX.unpack_from(view)[2]
    if header_len > MAX_HEADER_BYTES or _PREFIX.size + header_len > view.nbytes:
        raise KVCorruptError(f"KV header length {header_len} does not fit the {view.nbytes}-byte body")
    header = KVHeader.from_json(bytes(view[_PREFIX.size : _PREFIX.size + header_len]))
    return header, view[_PREFIX.size + header_len :]


def check_header(header: KVHeader, model: str, layout: KVLayout, token_ids: list[int]) -> None:
    if header.model != model:
        raise KVMismatchError(f"KV is for model {header.model!r}, this server serves {model!r}")
    theirs, ours = header.layout, layout
    for name in ("fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_size"):
        if getattr(theirs, name) != getattr(ours, name):
            raise KVMismatchError(
                f"KV {name} {getattr(theirs, name)!r} differs from this server's {getattr(ours, name)!r}"
                + (" (another model's weights)" if name == "fingerprint" else "")
            )
    if header.num_tokens != len(token_ids) or header.tokens_crc32 != tokens_crc32(token_ids):
        raise KVMismatchError(
            f"KV covers {header.num_tokens} prompt tokens that differ from the {len(token_ids)} this server "
            "tokenized (a different tokenizer or chat template?)"
        )
    if not 0 <= header.first_block <= layout.full_blocks(header.num_tokens):
        raise KVCorruptError(f"KV first block {header.first_block} is not a full block of {header.num_tokens} tokens")
    expected = payload_bytes(layout, header.num_tokens, header.first_block)
    if header.payload_bytes != expected:
        raise KVCorruptError(
            f"KV payload of {header.payload_bytes} bytes; {header.num_tokens} tokens from block "
            f"{header.first_block} need {expected}"
        )


@dataclass
class KVImport:
    """KV a request starts with: its first ``num_tokens`` prompt tokens' blocks, the ones before
    ``first_block`` from this server's prefix cache and the rest as ``payload`` (the wire layout
    above). The engine marks those tokens computed; the runner writes the payload into the
    request's blocks in the step that first schedules it."""

    num_tokens: int
    payload: memoryview
    first_block: int = 0


def encode_body(
    model: str,
    layout: KVLayout,
    token_ids: list[int],
    payload: memoryview,
    first_block: int = 0,
    key: bytes = UNKEYED,
) -> bytes:
    """A whole body in one piece: header, payload and MAC (a sender that streams the payload
    sends ``encode_header``, the payload, then ``body_mac`` of both)."""
    header = encode_header(model, layout, token_ids, payload, first_block)
    return header + bytes(payload) + body_mac(key, header, payload)
