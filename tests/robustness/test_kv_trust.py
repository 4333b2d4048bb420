"""KV transfer you can trust, with real prefill, decode and router processes: the transfer roles
refuse to start without a token unless told to be insecure; a decode server fetches KV only from
its prefill pool (a foreign URL, open port or closed, gets the same 403 and no connection); a
peer's error text never reaches the client; forged or altered KV fails its MAC and never enters
the prefix cache, whose answers stay the colocated server's."""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import struct
import threading
import time
import zlib

import httpx
import pytest

from llmfleet.server.core.kv_wire import MAC_BYTES, body_mac, kv_key
from llmfleet.server.wire.auth import KV_TOKEN_ENV
from tests.robustness.conftest import AUTH, MODEL, TRANSFER, post, report, serve
from tests.support import free_port

PROMPT = "Forged KV must never answer this prompt for anyone: " * 3


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_transfer_roles_refuse_to_start_without_a_token(fleet, role):
    refused = serve(fleet.tmp, f"{role}-no-token", "--role", role, env={KV_TOKEN_ENV: ""}, config=False)
    assert refused.proc.wait(60) != 0
    assert f"the {role} role needs {KV_TOKEN_ENV}" in refused.log_tail()


def test_insecure_transfer_is_an_explicit_loud_choice(fleet):
    insecure = serve(
        fleet.tmp, "prefill-insecure", "--role", "prefill", "--insecure-kv-transfer", env={KV_TOKEN_ENV: ""}
    )
    try:
        insecure.wait_ready(240)
        assert "INSECURE: --insecure-kv-transfer" in insecure.log_path.read_text()
    finally:
        insecure.stop()


@contextlib.contextmanager
def listener():
    """A loopback port that counts the connections made to it."""
    accepted = []
    sock = socket.create_server(("127.0.0.1", 0))
    sock.settimeout(0.2)
    stop = threading.Event()

    def serve_forever() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = sock.accept()
                accepted.append(conn)
                conn.close()

    thread = threading.Thread(target=serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", accepted
    finally:
        stop.set()
        thread.join()
        sock.close()


def transfer(url: str, remote_url: str, kv_id: str = "0" * 32):
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_url": remote_url, "remote_kv_ids": [kv_id]},
    }
    return post(url, "/v1/completions", body, TRANSFER)  # the fleet's token: only the pool guards it


def test_a_decode_server_fetches_from_no_address_a_request_names(fleet):
    with listener() as (open_url, accepted):
        closed_url = f"http://127.0.0.1:{free_port()}"
        foreign = [
            open_url,
            closed_url,
            f"{fleet.prefill.url}/elsewhere",
            fleet.prefill.url.replace("127.0.0.1", "localhost"),
        ]
        answers = [transfer(fleet.decode.url, url) for url in foreign]
        time.sleep(0.3)
    assert all(a.status_code == 403 for a in answers), [a.text for a in answers]
    messages = {a.json()["error"]["message"] for a in answers}
    assert len(messages) == 1 and "prefill servers" in messages.pop()  # open or closed: one answer
    report(f"foreign KV URLs: {len(foreign)} tried, {len(accepted)} connections made, 0 fetched")
    assert accepted == []


class Peer(http.server.ThreadingHTTPServer):
    """A 'prefill server' on loopback that serves the bodies it is given, or a 404 with words of
    its own."""

    def __init__(self, bodies: dict[str, bytes]) -> None:
        bodies_ = bodies

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                kv_id = self.path.split("/")[-1].split("?")[0]
                body = bodies_.get(kv_id)
                if body is None:
                    secret = b'{"error": {"message": "PEER-INTERNAL: db=10.0.0.9 password=hunter2"}}'
                    self.send_response(404)
                    self.send_header("Content-Length", str(len(secret)))
                    self.end_headers()
                    self.wfile.write(secret)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


def forgeries(genuine: bytes) -> dict[str, bytes]:
    """A real body turned into forged ones: the payload altered and its CRC32 recomputed into the
    header (what a forger could always do), then the MAC kept, or made with a key not the fleet's."""
    header_len = struct.unpack_from("<6sHI", genuine)[2]
    payload = bytes(b ^ 0x5A for b in genuine[12 + header_len : -MAC_BYTES])
    fields = json.loads(genuine[12 : 12 + header_len])
    fields["payload_crc32"] = zlib.crc32(payload)
    header = json.dumps(fields, sort_keys=True).encode()
    assert len(header) <= header_len
    head = genuine[:12] + header.ljust(header_len)  # JSON ignores the trailing blanks
    return {
        "a" * 32: head + payload + genuine[-MAC_BYTES:],  # altered, the old MAC kept
        "b" * 32: head + payload + body_mac(kv_key("a guessed token"), head, payload),  # signed, wrong key
        "c" * 32: head + payload + body_mac(kv_key(None), head, payload),  # signed as if insecure
    }


def test_forged_kv_is_refused_and_never_answers_anyone(fleet):
    ask = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    held = post(fleet.prefill.url, "/v1/completions", ask, TRANSFER).json()
    (kv_id,) = held["kv_transfer_params"]["remote_kv_ids"]
    genuine = httpx.get(f"{fleet.prefill.url}/v1/kv/{kv_id}", headers=TRANSFER, timeout=30).content
    bodies = forgeries(genuine)
    peer = Peer(bodies)
    try:
        fleet.pool_file.write_text(f"prefill:\n- {fleet.prefill.url}\n- {peer.url}\n")
        time.sleep(1.2)  # the decode server reads its pool again at most every second
        before = fleet.decode.metrics().get("llmfleet_kv_transfer_failures_total{reason=forged}", 0)
        answers = {kv: transfer(fleet.decode.url, peer.url, kv) for kv in bodies}
        missing = transfer(fleet.decode.url, peer.url, "d" * 32)  # the peer answers 404 with its own words
    finally:
        peer.shutdown()
        fleet.pool_file.write_text(f"prefill:\n- {fleet.prefill.url}\n")
    accepted = [kv for kv, a in answers.items() if a.status_code != 502]
    forged_count = fleet.decode.metrics()["llmfleet_kv_transfer_failures_total{reason=forged}"] - before
    report(
        f"forged KV: {len(bodies)} bodies tried (CRC32 recomputed), {len(accepted)} accepted, {forged_count:.0f} "
        "counted as forged"
    )
    assert not accepted and forged_count == len(bodies)
    assert missing.status_code == 502 and "PEER-INTERNAL" not in missing.text and "hunter2" not in missing.text
    # no forged block in the decode server's prefix cache: its answer is still the colocated one
    plain = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    want = post(fleet.colocated.url, "/v1/completions", plain, AUTH).json()["choices"][0]["text"]
    assert post(fleet.decode.url, "/v1/completions", plain).json()["choices"][0]["text"] == want
    assert post(fleet.router.url, "/v1/completions", plain).json()["choices"][0]["text"] == want
    assert fleet.decode.metrics()["llmfleet_kv_transfer_bytes_count{}"] >= 1  # the router's went through
