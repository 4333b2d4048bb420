"""A request can only ever fail itself: fuzzed sampling parameters share a batch with victim
requests, through LLMEngine + TorchModelRunner (the real torch sampler, float32, builtin:tiny),
under every batching policy, and every victim's greedy output equals its output alone.

The poison comes two ways: parameters the checks accept (extreme but valid), and parameters set
on a request after admission, past every check, as a bug elsewhere could leave them (NaN and inf
penalties, no candidate token left). The first may be refused at admission (a 400 naming the
field); whatever is admitted may fail only itself: finish_reason "abort" with its error."""

from __future__ import annotations

import functools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmfleet.server.config import EngineConfig
from llmfleet.server.core.request import SamplingParams
from llmfleet.server.core.validation import InvalidRequestError
from llmfleet.server.engine.build import build_engine
from tests.server.runner.device import DEVICE

POLICIES = {
    "static": dict(policy="static"),
    "dynamic": dict(policy="dynamic", batch_timeout_ms=1.0),
    "continuous-merged": dict(policy="continuous", prefill_mode="merged"),
    "continuous-prefill-first": dict(policy="continuous", prefill_mode="prefill_first"),
    "continuous-chunked": dict(policy="continuous", prefill_mode="chunked", max_num_batched_tokens=8),
}
VICTIMS = [[7, 8, 9, 10, 11], [100, 200, 300], [42] * 9]
MAX_TOKENS = 6
VOCAB = 512  # builtin:tiny's
TALLY = {"poison": 0, "refused": 0, "failed_alone": 0, "victims": 0, "victims_harmed": 0}

extreme = st.sampled_from([0.0, 1e-300, 1e-30, 1e-5, 0.5, 1.0, 2.0, 1e30, 1e300, math.inf, -math.inf, math.nan])
token_sets = st.sampled_from([[5], [1, 3], list(range(VOCAB)), list(range(2, VOCAB)), [10**9], []])
poison_fields = st.fixed_dictionaries(
    {},
    optional={
        "temperature": extreme,
        "top_p": extreme,
        "top_k": st.sampled_from([0, 1, 2, VOCAB, VOCAB + 7]),
        "min_p": extreme,
        "min_tokens": st.integers(0, MAX_TOKENS),
        "presence_penalty": extreme,
        "frequency_penalty": extreme,
        "repetition_penalty": extreme,
        "logit_bias": st.dictionaries(st.sampled_from([0, 1, 3, 5, VOCAB - 1]), extreme, max_size=3),
        "allowed_token_ids": token_sets,
        "stop_token_ids": token_sets,
        "ignore_eos": st.booleans(),
        "seed": st.none() | st.integers(0, 2**31),
    },
)


@functools.cache
def engine_for(policy: str):
    config = EngineConfig(dtype="float32", kv_block_size=4, max_batch_size=8, kv_cache_memory_mb=4, **POLICIES[policy])
    engine, _ = build_engine("builtin:tiny", config, device=DEVICE)
    return engine


@functools.cache
def alone() -> list[list[int]]:
    engine = engine_for("continuous-chunked")
    return [engine.generate([v], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0] for v in VICTIMS]


def values_of(fields: dict) -> dict:
    values = dict(fields)
    if "allowed_token_ids" in values:
        values["allowed_token_ids"] = frozenset(values["allowed_token_ids"])
    return values


def poisoned(fields: dict) -> SamplingParams:
    """The parameters through SamplingParams' checks (InvalidRequestError where they refuse)."""
    return SamplingParams(max_tokens=MAX_TOKENS, **values_of(fields))


def run(engine, poisons: list[tuple[dict, bool]]) -> tuple[dict, dict]:
    """Victims and the poisons in one batch: each request's tokens and final event. A poison with
    ``bypass`` is admitted plain and its fields set after admission, past every check."""
    for i, (fields, bypass) in enumerate(poisons):
        prompt = [5, 6, 7, 8][: 1 + i % 4]
        try:
            params = SamplingParams(max_tokens=MAX_TOKENS) if bypass else poisoned(fields)
            engine.add_request(f"poison-{i}", prompt, params)
        except InvalidRequestError:
            TALLY["refused"] += 1
            continue
        if bypass:
            for name, value in values_of(fields).items():
                setattr(params, name, value)
    for i, prompt in enumerate(VICTIMS):
        engine.add_request(f"victim-{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    tokens: dict[str, list[int]] = {}
    final = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        engine.flush()
        for event in engine.step():
            tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
            if event.finished:
                final[event.request_id] = event
    assert not engine.has_unfinished_requests()
    return tokens, final


@pytest.mark.parametrize("policy", list(POLICIES))
@given(st.lists(st.tuples(poison_fields, st.booleans()), min_size=1, max_size=3))
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_a_poisoned_request_fails_only_itself(policy, drawn):
    TALLY["poison"] += len(drawn)
    tokens, final = run(engine_for(policy), drawn)
    for i, expected in enumerate(alone()):
        TALLY["victims"] += 1
        rid = f"victim-{i}"
        harmed = final[rid].finish_reason != "length" or tokens[rid] != expected
        TALLY["victims_harmed"] += harmed
        assert not harmed, (rid, final[rid].finish_reason, tokens[rid], expected)
    for rid, event in final.items():
        if rid.startswith("poison-") and event.finish_reason == "abort":
            TALLY["failed_alone"] += 1
            assert event.error, "a request that failed on its own says why"


@pytest.mark.parametrize(
    "fields",
    [
        dict(repetition_penalty=1e-300, temperature=1.0),
        dict(allowed_token_ids=[5], stop_token_ids=[5], min_tokens=2),
        dict(stop_token_ids=list(range(VOCAB)), min_tokens=1),
    ],
    ids=["tiny-repetition-penalty", "allowed-all-stop", "stop-covers-vocab"],
)
def test_the_issue_poisons_are_refused_or_fail_alone(fields):
    """The issue's three: refused at admission, naming the field; set past the checks, each fails
    only its own request, with finish_reason abort and its error."""
    with pytest.raises(InvalidRequestError) as refused:
        engine_for("continuous-chunked").add_request("poison-0", [5, 6], poisoned(fields))
    assert refused.value.param in fields
    tokens, final = run(engine_for("continuous-merged"), [(fields, True)])
    assert final["poison-0"].finish_reason == "abort" and "no token" in final["poison-0"].error
    assert [tokens[f"victim-{i}"] for i in range(len(VICTIMS))] == alone()


def test_report_the_tally():
    """Printed for the record (pytest -s): poisons tried, victims and victims harmed."""
    print(f"\nsampling isolation: {TALLY}")
