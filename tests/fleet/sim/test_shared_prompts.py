"""Prompts that say what they share (a trace's content blocks, as Mooncake's hash_ids): the
simulated pods' prefix caches hit on them, the pool counts the hits as its servers do, and the
router's own policies (prefix affinity, round robin) pick the pods."""

from __future__ import annotations

from collections import defaultdict

import pytest

from llmfleet.operator.resource.spec import InferenceServiceSpec
from llmfleet.sim.fleet import Fleet, SimOptions
from llmfleet.sim.pod import SimPod, simulated_prompt
from llmfleet.workloads import RequestSpec
from tests.fleet.sim.conftest import make_spec

BLOCK = 64  # tokens per content block


def _with_policy(spec: InferenceServiceSpec, policy: str) -> InferenceServiceSpec:
    return spec.model_copy(update={"router": spec.router.model_copy(update={"policy": policy})})


def _system_prompt_requests(shared: bool) -> list[RequestSpec]:
    # 20 requests 2 s apart: 128 tokens of one system prompt, then 64 of their own
    return [RequestSpec(2.0 * i, 192, 4, (7, 8, 100 + i) if shared else (), BLOCK if shared else 0) for i in range(20)]


def test_a_prompt_is_its_blocks_then_its_own_tokens() -> None:
    assert simulated_prompt(5, (3, 4), 2, 9) == [3, 3, 4, 4, (1 << 62) + 9]
    assert simulated_prompt(3, (3, 4), 2, 9) == [3, 3, 4]  # a capped prompt: its first blocks
    assert simulated_prompt(2, (), 0, 9) == [(1 << 62) + 9] * 2


def test_prompts_sharing_blocks_hit_the_prefix_cache(profile) -> None:
    spec = make_spec(replicas=1, max_replicas=1)
    shared = Fleet(spec, profile, _system_prompt_requests(shared=True), SimOptions())
    alone = Fleet(spec, profile, _system_prompt_requests(shared=False), SimOptions())
    with_hits, without = shared.run(), alone.run()
    assert all(r.status == "finished" for r in (*with_hits.records, *without.records))
    # each request after the first finds the system prompt's 128 tokens cached
    assert shared.pools["colocated"].series.counters["prefix_cache_hits"] == 19 * 128
    assert alone.pools["colocated"].series.counters["prefix_cache_hits"] == 0
    assert all(a.ttft < b.ttft for a, b in zip(with_hits.records[1:], without.records[1:], strict=True))
    metrics = shared.metric_source.measure(shared.pool_ref("colocated"), 30.0)
    assert metrics.prefix_cache_hits_per_s > 0
    assert metrics.uncached_prompt_tokens_per_s() < metrics.prompt_tokens_per_s


def test_a_pool_with_prefix_caching_off_caches_nothing(profile) -> None:
    spec = make_spec(replicas=1, max_replicas=1, engine={"enablePrefixCaching": False})
    fleet = Fleet(spec, profile, _system_prompt_requests(shared=True), SimOptions())
    fleet.run()
    assert fleet.pools["colocated"].series.counters["prefix_cache_hits"] == 0


def test_prompts_of_lengths_alone_are_not_cached(profile) -> None:
    # filler prompts would all read as one prefix: pods without content to go by cache nothing
    fleet = Fleet(make_spec(replicas=1), profile, _system_prompt_requests(shared=False), SimOptions())
    assert not fleet.caches
    assert not fleet.pools["colocated"].pods[0].engine.config.enable_prefix_caching


def _conversations() -> list[RequestSpec]:
    # four conversations, six turns each 4 s apart: each turn's prompt is the last one's and more
    return [
        RequestSpec(
            4.0 * turn + conversation,
            64 * (turn + 1),
            4,
            tuple(range(100 * conversation, 100 * conversation + turn + 1)),
            BLOCK,
        )
        for turn in range(6)
        for conversation in range(4)
    ]


def _pods_per_conversation(policy: str, profile) -> list[int]:
    spec = _with_policy(make_spec(replicas=3, max_replicas=3), policy)
    requests = _conversations()
    result = Fleet(spec, profile, requests, SimOptions()).run()
    pods = defaultdict(set)
    for record in result.records:
        assert record.status == "finished"
        pods[requests[record.index].blocks[0]].add(record.pod)
    return [len(p) for p in pods.values()]


def test_the_prefix_policy_keeps_a_conversation_on_one_pod(profile) -> None:
    assert _pods_per_conversation("prefix", profile) == [1, 1, 1, 1]
    assert max(_pods_per_conversation("load", profile)) > 1  # the least loaded spreads the turns
    assert _pods_per_conversation("round-robin", profile) == [3, 3, 3, 3]  # 24 turns in turn over 3 pods


def test_a_disaggregated_fleets_prefill_pods_hit_on_shared_blocks(profile) -> None:
    # prefill pods compute the prompts, so theirs is the cache that hits; a one-token prompt
    # goes straight to a decode pod, which computes it
    requests = [*_system_prompt_requests(shared=True), RequestSpec(50.0, 1, 3)]
    for policy in ("load", "prefix"):
        fleet = Fleet(_with_policy(make_spec(mode="disaggregated", replicas=2), policy), profile, requests)
        assert all(r.status == "finished" for r in fleet.run().records)
        assert fleet.pools["prefill"].series.counters["prefix_cache_hits"] >= 18 * 128  # one miss per pod at most


def test_a_decode_pod_fetches_only_the_blocks_its_prefix_cache_lacks(profile, monkeypatch) -> None:
    # as its server does (first_block): over a slow link, a system prompt the decode pod already
    # holds is not fetched again, and its reuse counts as the pool's prefix-cache hits
    spec = make_spec(mode="disaggregated", replicas=1, max_replicas=1)
    slow = SimOptions(kv_transfer_bytes_per_s=profile.kv_bytes_per_token * 1000.0)  # 1000 tokens/s
    requests = _system_prompt_requests(shared=True)
    fleet = Fleet(spec, profile, requests, slow)
    fetching = fleet.run()
    monkeypatch.setattr(SimPod, "cached_prefix_blocks", lambda *_: 0)  # a decode pod that fetches it all
    everything = Fleet(spec, profile, requests, slow)
    fetching_all = everything.run()
    assert all(r.status == "finished" for r in (*fetching.records, *fetching_all.records))
    # the first request fetches the whole system prompt; the rest find its 128 tokens (one block
    # of the 191 transferred is partial and always sent)
    assert fleet.pools["decode"].series.counters["prefix_cache_hits"] == 19 * 128
    assert everything.pools["decode"].series.counters["prefix_cache_hits"] == 0
    for cached, whole in zip(fetching.records[1:], fetching_all.records[1:], strict=True):
        assert whole.ttft - cached.ttft == pytest.approx(0.128, abs=0.02)  # 128 tokens at 1000 tokens/s


def test_the_router_counts_a_request_on_its_decode_pod_while_its_kv_is_on_the_way(profile) -> None:
    # as the real router counts a request from the call: two prefills that end together, over a
    # slow link, go to two decode pods, not both to the one that was idle
    spec = make_spec(mode="disaggregated", replicas=2, max_replicas=2)
    slow = SimOptions(kv_transfer_bytes_per_s=profile.kv_bytes_per_token * 100.0)  # 100 tokens/s
    requests = [RequestSpec(0.0, 8, 400), RequestSpec(5.0, 64, 4), RequestSpec(5.0, 64, 4)]
    fleet = Fleet(spec, profile, requests, slow)
    result = fleet.run()
    assert all(r.status == "finished" for r in result.records)
    first, second = sorted(result.records, key=lambda r: r.index)[1:]
    assert first.pod != second.pod
    assert all(pod.incoming == 0 for pod in fleet.pools["decode"].pods)
