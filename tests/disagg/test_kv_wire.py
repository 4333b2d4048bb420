"""The KV transfer body: what passes, and the clear error for everything that must not."""

from __future__ import annotations

import dataclasses
import struct

import pytest

from llmfleet.server.api.kv_transfer import KVExportStore
from llmfleet.server.core.kv_wire import (
    PAYLOAD_ALIGN,
    KVCorruptError,
    KVLayout,
    KVMismatchError,
    decode,
    encode_header,
)

LAYOUT = KVLayout(fingerprint="abc123", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
TOKENS = [5, 6, 7, 8, 9, 10]  # two blocks of four


def body(layout: KVLayout = LAYOUT, tokens: list[int] = TOKENS, model: str = "m") -> bytes:
    payload = bytes(range(256)) * (layout.num_blocks(len(tokens)) * layout.block_bytes // 256)
    return encode_header(model, layout, tokens, memoryview(payload)) + payload


def test_a_body_round_trips_and_its_payload_is_aligned():
    raw = body()
    payload = decode(raw, "m", LAYOUT, TOKENS)
    assert payload.nbytes == 2 * LAYOUT.block_bytes
    assert (len(raw) - payload.nbytes) % PAYLOAD_ALIGN == 0


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"fingerprint": "other"}, "fingerprint"),
        ({"dtype": "bfloat16"}, "dtype"),
        ({"num_layers": 3}, "num_layers"),
        ({"num_kv_heads": 1}, "num_kv_heads"),
        ({"head_dim": 8}, "head_dim"),
        ({"block_size": 2}, "block_size"),
    ],
)
def test_a_layout_mismatch_is_refused_naming_the_difference(change, words):
    theirs = dataclasses.replace(LAYOUT, **change)
    with pytest.raises(KVMismatchError, match=words):
        decode(body(theirs), "m", LAYOUT, TOKENS)


def test_another_model_or_prompt_is_refused():
    with pytest.raises(KVMismatchError, match="model 'x'"):
        decode(body(model="x"), "m", LAYOUT, TOKENS)
    with pytest.raises(KVMismatchError, match="tokenizer"):
        decode(body(), "m", LAYOUT, [*TOKENS[:-1], 99])  # same length, other ids
    with pytest.raises(KVMismatchError, match="6 prompt tokens"):
        decode(body(), "m", LAYOUT, TOKENS[:-1])


def test_corruption_is_refused():
    raw = bytearray(body())
    raw[-1] ^= 0xFF
    with pytest.raises(KVCorruptError, match="checksum"):
        decode(raw, "m", LAYOUT, TOKENS)
    with pytest.raises(KVCorruptError, match="payload has"):
        decode(body()[:-8], "m", LAYOUT, TOKENS)
    with pytest.raises(KVCorruptError, match="magic"):
        decode(b"HTTP/1.1 200 OK\r\n\r\n", "m", LAYOUT, TOKENS)
    with pytest.raises(KVCorruptError, match="too short"):
        decode(b"LL", "m", LAYOUT, TOKENS)
    with pytest.raises(KVCorruptError, match="header"):
        decode(b"LLMFKV" + struct.pack("<HI", 1, 50) + b"{not json" + b" " * 41, "m", LAYOUT, TOKENS)
    future = bytearray(body())
    future[6:8] = struct.pack("<H", 2)
    with pytest.raises(KVMismatchError, match="version 2"):
        decode(future, "m", LAYOUT, TOKENS)


def test_encoding_refuses_a_payload_of_the_wrong_size():
    with pytest.raises(ValueError, match="payload has"):
        encode_header("m", LAYOUT, TOKENS, memoryview(b"x" * 10))


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_export_store_hands_each_kv_out_once_and_frees_what_nobody_takes():
    clock = Clock()
    store = KVExportStore(ttl_s=10, limit_bytes=1000, clock=clock)
    first = store.put(b"h" * 10, memoryview(b"p" * 90))
    assert store.held_bytes == 100
    assert store.take(first).nbytes == 100
    assert store.take(first) is None and store.held_bytes == 0  # one-shot

    expiring = store.put(b"h", memoryview(b"p" * 99))
    clock.now = 11
    store.expire()
    assert store.take(expiring) is None and store.held_bytes == 0 and store.dropped == 1

    oldest = store.put(b"h", memoryview(b"p" * 599))
    newest = store.put(b"h", memoryview(b"p" * 599))  # over the limit: the oldest goes
    assert store.take(oldest) is None
    assert store.take(newest) is not None
    assert store.held_bytes == 0 and len(store) == 0
