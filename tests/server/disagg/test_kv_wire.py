"""The KV transfer body: what passes, and the clear error for everything that must not."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import struct
import types

import httpx
import pytest

from llmfleet.server.core.kv_wire import (
    MAC_BYTES,
    MAX_HEADER_BYTES,
    PAYLOAD_ALIGN,
    UNKEYED,
    VERSION,
    KVCorruptError,
    KVForgedError,
    KVHeader,
    KVLayout,
    KVMismatchError,
    body_mac,
    decode,
    encode_body,
    encode_header,
    kv_key,
    leave_out_blocks,
)
from llmfleet.server.http.errors import APIError
from llmfleet.server.http.kv_store import KVExportStore
from llmfleet.server.http.prefill_peers import PrefillPeers
from llmfleet.server.openai.kv_transfer import receive
from llmfleet.server.openai.protocol import KVTransferParams
from llmfleet.server.wire.endpoints import StaticEndpoints

LAYOUT = KVLayout(fingerprint="abc123", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
TOKENS = [5, 6, 7, 8, 9, 10]  # two blocks of four


def body(layout: KVLayout = LAYOUT, tokens: list[int] = TOKENS, model: str = "m", key: bytes = UNKEYED) -> bytes:
    payload = bytes(range(256)) * (layout.num_blocks(len(tokens)) * layout.block_bytes // 256)
    return encode_body(model, layout, tokens, memoryview(payload), key=key)


def signed(raw: bytes, key: bytes = UNKEYED) -> bytes:
    """``raw`` with the MAC a holder of ``key`` gives it."""
    return raw + body_mac(key, raw)


def test_a_body_round_trips_and_its_payload_is_aligned():
    raw = body()
    payload = decode(raw, "m", LAYOUT, TOKENS)
    assert payload.nbytes == 2 * LAYOUT.block_bytes
    assert (len(raw) - MAC_BYTES - payload.nbytes) % PAYLOAD_ALIGN == 0


def test_a_body_made_or_altered_without_the_token_is_refused_as_forged():
    """The forger can recompute every checksum in the header (CRC32 only, once): not the MAC."""
    key = kv_key("the-fleets-token")
    assert bytes(decode(body(key=key), "m", LAYOUT, TOKENS, key=key)) == bytes(decode(body(), "m", LAYOUT, TOKENS))
    with pytest.raises(KVForgedError, match="MAC"):  # made with another key, or none
        decode(body(key=kv_key("a guess")), "m", LAYOUT, TOKENS, key=key)
    with pytest.raises(KVForgedError, match="MAC"):
        decode(body(), "m", LAYOUT, TOKENS, key=key)
    # the payload altered and its CRC32 recomputed into the header, the old MAC kept
    raw = body(key=key)
    header_len = struct.unpack_from("<6sHI", raw)[2]
    header = KVHeader.from_json(raw[12 : 12 + header_len])
    payload = bytearray(raw[12 + header_len : -MAC_BYTES])
    payload[0] ^= 0xFF
    forged_header = encode_header("m", LAYOUT, TOKENS, memoryview(bytes(payload)))
    assert KVHeader.from_json(forged_header[12:]).payload_crc32 != header.payload_crc32
    with pytest.raises(KVForgedError, match="MAC"):
        decode(forged_header + bytes(payload) + raw[-MAC_BYTES:], "m", LAYOUT, TOKENS, key=key)


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
    raw[-MAC_BYTES - 1] ^= 0xFF
    with pytest.raises(KVForgedError, match="MAC"):
        decode(raw, "m", LAYOUT, TOKENS)
    unsigned = body()[:-MAC_BYTES]
    with pytest.raises(KVCorruptError, match="checksum"):  # corrupted before it was signed
        decode(signed(unsigned[:-1] + bytes([unsigned[-1] ^ 0xFF])), "m", LAYOUT, TOKENS)
    with pytest.raises(KVCorruptError, match="payload has"):
        decode(signed(unsigned[:-8]), "m", LAYOUT, TOKENS)
    with pytest.raises(KVCorruptError, match="magic"):
        decode(b"HTTP/1.1 200 OK\r\n\r\n" + b" " * MAC_BYTES, "m", LAYOUT, TOKENS)
    with pytest.raises(KVCorruptError, match="too short"):
        decode(b"LL", "m", LAYOUT, TOKENS)
    with pytest.raises(KVCorruptError, match="header"):
        decode(signed(b"LLMFKV" + struct.pack("<HI", VERSION, 50) + b"{not json" + b" " * 41), "m", LAYOUT, TOKENS)
    for not_an_object in (b'"x"', b"null", b"42"):
        with pytest.raises(KVCorruptError, match="header"):
            raw = signed(b"LLMFKV" + struct.pack("<HI", VERSION, len(not_an_object)) + not_an_object)
            decode(raw, "m", LAYOUT, TOKENS)
    future = bytearray(body())
    future[6:8] = struct.pack("<H", VERSION + 1)
    with pytest.raises(KVMismatchError, match=f"version {VERSION + 1}"):
        decode(future, "m", LAYOUT, TOKENS)


def test_a_body_may_leave_out_the_blocks_the_receiver_has_cached():
    tokens = [*TOKENS, 11, 12, 13]  # three blocks, two of them full
    # every (layer, keys or values, head) row holds its three blocks side by side: 0, 1, 2
    row = b"".join(bytes([b]) * (LAYOUT.block_bytes // 8) for b in range(3))
    tail = leave_out_blocks(memoryview(row * 8), LAYOUT, len(tokens), first_block=1)
    assert bytes(tail) == row[len(row) // 3 :] * 8  # blocks 1 and 2 of every row
    raw = encode_body("m", LAYOUT, tokens, tail, first_block=1)
    assert bytes(decode(raw, "m", LAYOUT, tokens, first_block=1)) == bytes(tail)
    with pytest.raises(KVCorruptError, match="starts at block 1; block 0 was asked for"):
        decode(raw, "m", LAYOUT, tokens)
    with pytest.raises(KVMismatchError, match="tokenizer"):  # the whole prompt is still checked
        decode(raw, "m", LAYOUT, [99, *tokens[1:]], first_block=1)
    empty = encode_body("m", LAYOUT, TOKENS[:4] * 2, memoryview(b""), first_block=2)  # all cached
    assert decode(empty, "m", LAYOUT, TOKENS[:4] * 2, first_block=2).nbytes == 0
    with pytest.raises(ValueError, match="first block 3"):  # the partial block always travels
        encode_header("m", LAYOUT, tokens, memoryview(b""), first_block=3)


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
    first = store.put(TOKENS, memoryview(b"p" * 100))
    assert store.held_bytes == 100
    assert store.get(first).nbytes == 100 and store.held_bytes == 100  # a look takes nothing
    assert store.take(first).nbytes == 100
    assert store.take(first) is None and store.held_bytes == 0  # one-shot

    expiring = store.put(TOKENS, memoryview(b"p" * 100))
    clock.now = 11
    store.expire()
    assert store.take(expiring) is None and store.held_bytes == 0 and store.dropped == 1

    oldest = store.put(TOKENS, memoryview(b"p" * 600))
    newest = store.put(TOKENS, memoryview(b"p" * 600))  # over the limit: the oldest goes
    assert store.take(oldest) is None
    assert store.take(newest) is not None
    assert store.held_bytes == 0 and len(store) == 0

    kept = store.put(TOKENS, memoryview(b"p" * 100))
    assert store.put(TOKENS, memoryview(b"p" * 1001)) is None  # no id for KV nobody could fetch
    assert store.take(kept) is not None  # and nothing else was pushed out for it


async def test_kv_nobody_takes_is_freed_at_its_ttl_with_no_traffic():
    """No request and no scrape after the prefills: their KV still goes when the TTL runs out."""
    store = KVExportStore(ttl_s=0.1, limit_bytes=1000)
    store.put(TOKENS, memoryview(b"p" * 100))
    store.put(TOKENS, memoryview(b"p" * 100))
    await asyncio.sleep(0.5)
    assert len(store) == 0 and store.held_bytes == 0 and store.dropped == 2


# --- the decode side's fetch ---------------------------------------------------------------------
class FetchMetrics:
    def __init__(self):
        self.failures = []

    def count_kv_failure(self, reason):
        self.failures.append(reason)

    def observe_kv_transfer(self, nbytes, seconds):
        pass

    def count_kv_cached_tokens(self, n):
        pass


def decode_state(chunks):
    """A decode server whose prefill peer answers with ``chunks``; ``sent`` counts what it sent."""
    sent = []

    async def stream():
        for chunk in chunks:
            sent.append(len(chunk))
            yield chunk

    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(200, content=stream())))
    engine = types.SimpleNamespace(cached_prefix_blocks=lambda tokens, salt=None, prompt_tokens=None: 0)
    state = types.SimpleNamespace(role="decode", model_name="m", kv_layout=LAYOUT, engine=engine, kv_token=None)
    state.metrics, state.http_client = FetchMetrics(), lambda: client
    state.prefill_peers = PrefillPeers(StaticEndpoints(["http://p"], []))
    return state, sent


def fetch(state):
    params = KVTransferParams(do_remote_prefill=True, remote_url="http://p", remote_kv_ids=["0" * 32])
    return asyncio.run(receive(state, params, [[*TOKENS, 11]]))


def test_the_decode_side_fetches_and_imports_a_body():
    state, _ = decode_state([body()[:100], body()[100:]])
    (kv,) = fetch(state)
    assert kv.num_tokens == len(TOKENS) and kv.payload.nbytes == 2 * LAYOUT.block_bytes


def test_the_decode_side_stops_reading_a_body_longer_than_any_for_its_prompt():
    # A peer that sends without end costs this server one body's worth of memory, then a 502
    state, sent = decode_state(itertools.chain([body()], itertools.repeat(b"\0" * 65536)))
    with pytest.raises(APIError) as raised:
        fetch(state)
    assert raised.value.status == 502 and "could not hand over" in raised.value.message
    assert sum(sent) < len(body()) + 3 * 65536 + MAX_HEADER_BYTES
    assert state.metrics.failures == ["fetch"]


def test_an_oversized_body_from_another_layout_is_still_named_a_mismatch():
    theirs = dataclasses.replace(LAYOUT, dtype="float32", num_layers=8)  # four times our payload
    state, _ = decode_state([body(theirs)])
    with pytest.raises(APIError) as raised:
        fetch(state)
    assert raised.value.status == 409 and "num_layers" in raised.value.message


def test_a_failed_kv_fetch_logs_only_a_peers_error_message():
    """What a peer said goes to the log, and of it only an OpenAI-style error's message."""
    import httpx

    from llmfleet.server.openai.kv_transfer import _their_error

    ours = httpx.Response(404, json={"error": {"message": "no KV under id k (expired or taken)"}})
    assert _their_error(ours) == ": no KV under id k (expired or taken)"
    assert _their_error(httpx.Response(404, text="INTERNAL-SECRET: db-password=hunter2")) == ""
    assert _their_error(httpx.Response(500, json={"secret": "x"})) == ""


@pytest.mark.parametrize(
    ("url", "taken"),
    [
        ("http://10.0.0.7:8000", True),
        ("http://prefill.ml.svc:8000/", True),
        ("https://gateway/llm/prefill", True),  # a --prefill-url behind a path prefix
        ("http://10.0.0.7:8000/metrics#", False),  # the fetch's own path cut off
        ("http://10.0.0.7:8000/x?to=", False),
        ("http://10.0.0.7:8000/llm/../admin", False),
    ],
)
def test_a_transfer_names_a_servers_url_and_nothing_that_steers_the_fetch(url, taken):
    params = {"do_remote_prefill": True, "remote_url": url, "remote_kv_ids": ["0" * 32]}
    if taken:
        KVTransferParams.model_validate(params)
    else:
        with pytest.raises(ValueError):
            KVTransferParams.model_validate(params)
    with pytest.raises(ValueError):
        KVTransferParams.model_validate(params | {"remote_url": "http://p", "remote_kv_ids": ["../../admin"]})


def test_the_decode_side_fetches_from_its_prefill_servers_only_and_tells_nothing_of_them():
    """A URL outside the pool is refused with no connection made; a peer's failure is a generic 502."""
    connections = []

    def peer(request):
        connections.append(str(request.url))
        return httpx.Response(404, json={"error": {"message": "INTERNAL: the peer's own words"}})

    state, _ = decode_state([])
    state.http_client = lambda: httpx.AsyncClient(transport=httpx.MockTransport(peer))
    for url in ("http://127.0.0.1:22", "http://p:80", "https://p", "http://metadata.internal"):
        params = KVTransferParams(do_remote_prefill=True, remote_url=url, remote_kv_ids=["0" * 32])
        with pytest.raises(APIError) as raised:
            asyncio.run(receive(state, params, [[*TOKENS, 11]]))
        assert raised.value.status == 403 and "prefill servers" in raised.value.message
    assert connections == [] and state.metrics.failures == ["unknown_peer"] * 4
    with pytest.raises(APIError) as raised:
        fetch(state)
    assert raised.value.status == 502 and "INTERNAL" not in raised.value.message and len(connections) == 1


def test_forged_kv_from_a_known_peer_is_refused_and_counted():
    state, _ = decode_state([body(key=kv_key("not the fleet's"))])
    state.kv_token = "the fleet's"
    with pytest.raises(APIError) as raised:
        fetch(state)
    assert raised.value.status == 502 and state.metrics.failures == ["forged", "fetch"]
