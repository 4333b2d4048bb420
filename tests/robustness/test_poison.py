"""A request can only fail itself, on a real colocated server and through the router: while eight
greedy streams of other clients run, poison requests (the issue's three, and others that pass
admission only to fail in the sampler) are refused with a 400 naming the field, or end alone with
finish_reason "abort" and an error the client can read. Every victim's text is its text alone."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.robustness.conftest import AUTH, MODEL, Fleet, post, report, running_fleet

VICTIMS = [f"Victim {i}: the quick brown fox jumps over the lazy dog, again and again" for i in range(8)]
VICTIM_TOKENS = 400  # long enough that every poison meets them in the batch
CONTEXT = 512  # the shared fleet's 128 tokens end a victim in ~0.4 s, about when the poisons land
# name -> (fields over a plain completion, what it gets: the 400's param, or "abort")
POISONS = {
    "tiny-repetition-penalty": ({"repetition_penalty": 1e-300, "temperature": 1}, "repetition_penalty"),
    "allowed-all-stop": ({"allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 2}, "allowed_token_ids"),
    "stop-covers-vocab": ({"stop_token_ids": list(range(512)), "min_tokens": 1}, "stop_token_ids"),
    "regex-too-large": ({"structured_outputs": {"regex": "(a{1000}){1000}"}}, "structured_outputs.regex"),
    "schema-only-itself": ({"structured_outputs": {"json": {"$ref": "#"}}}, "structured_outputs.json"),
    "nan-penalty": ({"presence_penalty": "NaN"}, "presence_penalty"),
    # admitted: an infinite float32 temperature over masked logits makes NaN probabilities
    "huge-temperature-allowed": ({"temperature": 1e300, "allowed_token_ids": [5, 6]}, "abort"),
    "huge-temperature-min-tokens": ({"temperature": 1e300, "min_tokens": 4}, "abort"),
}
TALLY = {"poisons": 0, "victims": 0, "harmed": 0}


def alone(url: str, headers: dict) -> list[str]:
    texts = []
    for prompt in VICTIMS:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": VICTIM_TOKENS, "temperature": 0, "ignore_eos": True}
        answer = post(url, "/v1/completions", body, headers)
        assert answer.status_code == 200, answer.text
        texts.append(answer.json()["choices"][0]["text"])
    return texts


def victim(url: str, headers: dict, prompt: str, started: threading.Barrier) -> tuple[str, str | None, list, float]:
    """One victim's stream: its text, finish reason, any error events, and when it ended."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": VICTIM_TOKENS, "temperature": 0, "ignore_eos": True}
    text, finish, errors = "", None, []
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200
        waited = False
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
                continue
            for choice in chunk["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
            if not waited:  # every victim is generating before the poisons go in
                waited = True
                started.wait(timeout=60)
    return text, finish, errors, time.monotonic()


def poison(url: str, headers: dict, name: str, stream: bool) -> float:
    fields, expected = POISONS[name]
    body = {"model": MODEL, "prompt": "poison", "max_tokens": 8, **fields, "stream": stream}
    answer = post(url, "/v1/completions", body, headers)
    if expected != "abort":
        assert answer.status_code == 400, (name, answer.text)
        assert answer.json()["error"]["param"] == expected, (name, answer.text)
        return time.monotonic()
    assert answer.status_code == 200, (name, answer.text)
    if not stream:
        (choice,) = answer.json()["choices"]
        assert choice["finish_reason"] == "abort" and choice["error"]["type"] == "generation_error", (name, choice)
        return time.monotonic()
    events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["type"] == "generation_error", (name, events[-1])
    assert any(c["finish_reason"] == "abort" for e in events for c in e.get("choices", [])), name
    return time.monotonic()


@pytest.fixture(scope="module")
def long_fleet(tmp_path_factory) -> Iterator[Fleet]:
    with running_fleet(tmp_path_factory.mktemp("poison"), context=CONTEXT) as started:
        yield started


@pytest.mark.parametrize("through", ["colocated", "router"])
def test_poison_requests_never_touch_other_streams(long_fleet, through):
    fleet = long_fleet
    url, headers = (fleet.colocated.url, AUTH) if through == "colocated" else (fleet.router.url, {})
    expected = alone(url, headers)
    started = threading.Barrier(len(VICTIMS) + 1)
    with concurrent.futures.ThreadPoolExecutor(len(VICTIMS) + 4) as pool:
        streams = [pool.submit(victim, url, headers, prompt, started) for prompt in VICTIMS]
        started.wait(timeout=120)
        # those that reach the sampler first: they must share steps with the victims
        order = sorted(POISONS, key=lambda name: POISONS[name][1] != "abort")
        poisons = [pool.submit(poison, url, headers, name, stream) for name in order for stream in (False, True)]
        in_sampler = max(
            done.result()
            for done, name in zip(poisons, [n for n in order for _ in (0, 1)], strict=True)
            if POISONS[name][1] == "abort"
        )
        for done in poisons:
            done.result()
        results = [s.result() for s in streams]
    assert in_sampler < min(ended for *_, ended in results), "a victim ended before the poisons reached the sampler"
    outcomes = [result[:3] for result in results]
    harmed = [i for i, outcome in enumerate(outcomes) if outcome != (expected[i], "length", [])]
    TALLY["poisons"] += len(poisons)
    TALLY["victims"] += len(VICTIMS)
    TALLY["harmed"] += len(harmed)
    report(
        f"poison ({through}): {len(poisons)} poison requests x {len(VICTIMS)} concurrent victim streams, "
        f"{len(harmed)} victims harmed"
    )
    assert not harmed, [(i, outcomes[i], expected[i]) for i in harmed]
