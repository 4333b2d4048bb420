"""The KV transfer wire format between a prefill and a decode server. Pure Python, no torch.

One body per request (per prompt)::

    b"LLMFKV" | version: u16 LE | header length: u32 LE | header (UTF-8 JSON) | payload

The header names everything the receiver must agree with before it writes a single byte into its
cache: the model (served name and a fingerprint of its weights), dtype, layers, KV heads, head
dim and block size, plus how many prompt tokens the KV covers, a checksum of those token ids (the
receiver tokenized the prompt itself: a tokenizer mismatch must not pass) and of the payload.

The payload is the request's KV blocks, block-major as the paged cache holds them:
``(num_layers, 2 [keys, values], num_kv_heads, num_blocks, block_size * head_dim)`` in ``dtype``.
The last block is only partly filled; the receiver overwrites the rest as it decodes.
"""

from __future__ import annotations

import json
import struct
import zlib
from array import array
from dataclasses import asdict, dataclass

MAGIC = b"LLMFKV"
VERSION = 1
_PREFIX = struct.Struct("<6sHI")  # magic, version, header length
MAX_HEADER_BYTES = 64 * 1024
PAYLOAD_ALIGN = 64  # the payload starts at a multiple of this offset, so it can be viewed as floats

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


class KVMismatchError(ValueError):
    """The KV body does not fit this server (other model, layout or prompt): answer 4xx."""


class KVCorruptError(ValueError):
    """The KV body is malformed or its checksum fails: answer 4xx, never write it."""


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


@dataclass(frozen=True)
class KVHeader:
    model: str  # the served model name
    layout: KVLayout
    num_tokens: int  # prompt tokens the KV covers (positions 0 .. num_tokens - 1)
    tokens_crc32: int
    payload_bytes: int
    payload_crc32: int

    def to_json(self) -> bytes:
        fields = asdict(self)
        fields.update(fields.pop("layout"))
        return json.dumps({"version": VERSION, **fields}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> KVHeader:
        try:
            fields = json.loads(raw)
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


def encode_header(model: str, layout: KVLayout, token_ids: list[int], payload: memoryview) -> bytes:
    """The prefix and header for ``payload`` (the KV of ``token_ids``); the payload follows it."""
    expected = layout.num_blocks(len(token_ids)) * layout.block_bytes
    if payload.nbytes != expected:
        raise ValueError(f"payload has {payload.nbytes} bytes, the layout needs {expected}")
    header = KVHeader(model, layout, len(token_ids), tokens_crc32(token_ids), payload.nbytes, zlib.crc32(payload))
    raw = header.to_json()
    raw += b" " * (-(_PREFIX.size + len(raw)) % PAYLOAD_ALIGN)  # JSON ignores trailing blanks
    return _PREFIX.pack(MAGIC, VERSION, len(raw)) + raw


def decode(body: bytes | bytearray | memoryview, model: str, layout: KVLayout, token_ids: list[int]) -> memoryview:
    """Check a received body against this server and the prompt it will serve; return the payload.

    Raises KVCorruptError (malformed, truncated, checksum) or KVMismatchError (another model,
    layout or prompt), each with a message that says what differs."""
    view = memoryview(body)
    if view.nbytes < _PREFIX.size:
        raise KVCorruptError(f"KV body too short ({view.nbytes} bytes)")
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise KVCorruptError("not a KV transfer body (bad magic)")
    if version != VERSION:
        raise KVMismatchError(f"KV format version {version}; this server reads version {VERSION}")
    if header_len > MAX_HEADER_BYTES or _PREFIX.size + header_len > view.nbytes:
        raise KVCorruptError(f"KV header length {header_len} does not fit the {view.nbytes}-byte body")
    header = KVHeader.from_json(bytes(view[_PREFIX.size : _PREFIX.size + header_len]))
    payload = view[_PREFIX.size + header_len :]
    check_header(header, model, layout, token_ids)
    if payload.nbytes != header.payload_bytes:
        raise KVCorruptError(f"KV payload has {payload.nbytes} bytes, the header says {header.payload_bytes}")
    if zlib.crc32(payload) != header.payload_crc32:
        raise KVCorruptError("KV payload checksum mismatch: the transfer was corrupted")
    return payload


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
    expected = layout.num_blocks(header.num_tokens) * layout.block_bytes
    if header.payload_bytes != expected:
        raise KVCorruptError(f"KV payload of {header.payload_bytes} bytes; {header.num_tokens} tokens need {expected}")


@dataclass
class KVImport:
    """KV a request starts with: the first ``num_tokens`` prompt tokens' blocks, as ``payload``
    (the wire layout above). The engine marks those tokens computed; the runner writes the
    payload into the request's first blocks in the step that first schedules it."""

    num_tokens: int
    payload: memoryview
