"""Bounded work per request on a real server: a body past --max-request-body-mb is a 413 before it
is read, a prompt longer than the context can hold is a 400 before it is tokenized (/tokenize
too), and while several of the largest requests the server accepts are in flight (4 MiB bodies:
text cut with truncate_prompt_tokens, or token ids), a small request waits behind one of them at
most, never behind all, and the server's memory grows by at most a few hundred MB. The wait is
judged against one large request's time alone on the same machine, so a slow machine moves both."""

from __future__ import annotations

import concurrent.futures
import json
import statistics
import threading
import time

import pytest

from llmfleet.server.http.body_guard import DEFAULT_MAX_BODY_MB
from tests.robustness.conftest import AUTH, MODEL, post, report, rss_mb

LIMIT = int(DEFAULT_MAX_BODY_MB * 2**20)
IN_FLIGHT = 6


def small(url: str) -> float:
    return timed(url, {"model": MODEL, "prompt": "hi", "max_tokens": 4})


def timed(url: str, body) -> float:
    """Seconds for one completion request, which must succeed."""
    started = time.perf_counter()
    answer = post(url, "/v1/completions", body, AUTH)
    assert answer.status_code == 200, answer.text
    return time.perf_counter() - started


def largest(kind: str) -> bytes:
    """A body just under the limit that the server accepts: a long text or a long list of ids,
    of which truncate_prompt_tokens keeps the last 64 tokens."""
    body = {"model": MODEL, "max_tokens": 4, "truncate_prompt_tokens": 64, "prompt": ""}
    room = LIMIT - len(json.dumps(body)) - 16
    body["prompt"] = "word " * (room // 5) if kind == "text" else [7] * (room // 3)
    raw = json.dumps(body).encode()
    assert LIMIT - 64 < len(raw) <= LIMIT
    return raw


def test_a_body_past_the_limit_is_a_413_and_a_prompt_past_the_context_a_400(fleet):
    url = fleet.colocated.url
    started = time.perf_counter()
    over = post(url, "/v1/completions", b'{"prompt": "' + b"x" * LIMIT + b'"}', AUTH)
    assert over.status_code == 413 and over.json()["error"]["code"] == 413
    text = "word " * 200_000  # 1 MB: far past what the context can hold
    for path, body in (("/v1/completions", {"prompt": text}), ("/tokenize", {"prompt": text})):
        refused = post(url, path, {"model": MODEL, **body}, AUTH)
        assert refused.status_code == 400 and "maximum context length" in refused.json()["error"]["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    assert post(url, "/v1/chat/completions", chat, AUTH).status_code == 400
    assert time.perf_counter() - started < 10  # refused, not worked through
    ids = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": list(range(600))}, AUTH)
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "stop_token_ids"


@pytest.mark.parametrize("kind", ["text", "ids"])
def test_the_largest_requests_do_not_starve_small_ones(fleet, kind):
    server = fleet.colocated
    body = largest(kind)
    alone = statistics.median(small(server.url) for _ in range(5))
    one_large = statistics.median(timed(server.url, body) for _ in range(3))
    before = rss_mb(server.proc.pid)
    peak, latencies, stop = [before], [], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak.append(rss_mb(server.proc.pid))
            time.sleep(0.05)

    def probe() -> None:
        while not stop.is_set():
            latencies.append(small(server.url))
            time.sleep(0.05)

    watchers = [threading.Thread(target=watch), threading.Thread(target=probe)]
    for thread in watchers:
        thread.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
            answers = list(pool.map(lambda _: post(server.url, "/v1/completions", body, AUTH), range(IN_FLIGHT)))
    finally:
        stop.set()
        for thread in watchers:
            thread.join()
    assert all(a.status_code == 200 for a in answers), [a.text[:200] for a in answers]
    assert all(a.json()["usage"]["prompt_tokens"] == 64 for a in answers)
    delay, growth = max(latencies) - alone, max(peak) - before
    report(
        f"bounded work ({kind}): {IN_FLIGHT} x {len(body)}-byte requests in flight; a 4-token request "
        f"{alone:.3f} s alone, worst {max(latencies):.3f} s during ({len(latencies)} sent; one large request "
        f"alone {one_large:.3f} s); "
        f"RSS {before:.0f} -> peak {max(peak):.0f} MB (+{growth:.0f})"
    )
    # Behind every large body in turn, a small request would wait about 2 x IN_FLIGHT of them (each
    # turn rests as long as it ran); a slow machine stretches both
    assert delay < max(1.0, 3 * one_large) and growth < 300
