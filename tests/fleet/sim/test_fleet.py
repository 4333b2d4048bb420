"""The simulated fleet: every request accounted for, determinism, start-up delay, drains, the HPA
baseline and disaggregated pools. A synthetic cost profile: no torch, no timing."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from llmfleet.operator.metrics.source import PoolMetrics, PoolRef
from llmfleet.sim.fleet import Fleet, SimOptions
from llmfleet.sim.hpa import HPAConfig, QueueLengthHPA
from llmfleet.sim.pod import PodConfigError, PodState
from llmfleet.sim.report import direction_changes, per_minute, save_plot, summarize
from llmfleet.sim.simulate import simulate
from llmfleet.workloads import PhasedWorkload, RequestSpec, Workload
from tests.fleet.sim.conftest import make_spec


def poisson(n: int, rate: float, prompt=(16, 256), output=(8, 64), seed: int = 0) -> list[RequestSpec]:
    return Workload("t", n, seed=seed, rate_per_s=rate, prompt_len=prompt, output_len=output).requests()


@dataclass
class Script:
    """A controller that scales the pool at given times: (time, replicas)."""

    fleet: Fleet
    steps: list[tuple[float, int]]
    name: str = "script"
    interval_s: float = 1.0

    def control(self, now: float) -> None:
        for at, replicas in self.steps:
            if at <= now < at + self.interval_s:
                self.fleet.scale("colocated", replicas)


def scripted(steps: list[tuple[float, int]]):
    return lambda fleet: Script(fleet, steps)


def test_every_arrival_is_accounted_for_once(profile) -> None:
    requests = poisson(300, 20.0, output=(8, 128))
    requests.append(RequestSpec(1.0, 5000, 10))  # longer than builtin:small's 4096 positions: 400
    spec = make_spec(engine={"maxQueueLen": 8, "maxBatchSize": 4}, max_replicas=2)
    result = simulate(spec, profile, requests, controller="tuner", options=SimOptions(tail_s=5.0))
    assert len(result.records) == len(requests) and result.conserved
    status = summarize(result)["status"]
    assert set(status) == {"finished", "rejected", "unfinished"}, status
    assert sum(status.values()) == len(requests)
    details = [r.detail for r in result.records if r.status == "rejected"]
    assert any(d.startswith("429") for d in details) and any("maximum context length" in d for d in details)
    for r in result.records:
        if r.status == "finished":
            assert len(r.token_times) == r.output_len and r.token_times == sorted(r.token_times)
            assert r.token_times[0] > r.arrival


def test_runs_are_deterministic(profile) -> None:
    requests = poisson(200, 4.0)
    spec = make_spec(ttft_ms=500, itl_ms=80, engine={"batchTimeoutMs": 20})

    def run():
        result = simulate(spec, profile, requests, controller="tuner")
        return [r.token_times for r in result.records], [(d.at, d.changes) for d in result.decisions], summarize(result)

    assert run() == run()


def test_scale_up_waits_for_the_start_up_delay(profile) -> None:
    requests = poisson(400, 4.0)
    result = Fleet(make_spec(), profile, requests, SimOptions(startup_s=30.0), scripted([(10.0, 2)])).run()
    starting = [p.at for p in result.timeline if p.pools["colocated"]["starting"] == 1]
    assert min(starting) == pytest.approx(10.0, abs=1.0) and max(starting) < 40.0
    served = [r for r in result.records if r.pod == "colocated-2"]
    assert served and min(r.dispatched_at for r in served) >= 40.0
    assert ("colocated-2", "colocated", 10.0, result.end) in result.pod_lifetimes  # paid for from the scale-up


def test_scale_down_drains_without_aborting(profile) -> None:
    requests = poisson(300, 6.0, output=(32, 128))
    spec = make_spec(replicas=2)
    fleet = Fleet(spec, profile, requests, SimOptions(), scripted([(20.0, 1)]))
    result = fleet.run()
    assert all(r.status == "finished" for r in result.records)
    drained = next(p for p in fleet.pools["colocated"].pods if p.state == PodState.STOPPED)
    served = [r for r in result.records if r.pod == drained.name]
    assert served and all(r.dispatched_at < 20.0 for r in served)  # out of the router at once
    assert drained.stopped_at == pytest.approx(max(r.token_times[-1] for r in served))  # stops after its last token
    assert drained.stopped_at > 20.0


def test_a_drain_past_its_deadline_aborts_what_is_left(profile) -> None:
    requests = poisson(40, 8.0, output=(1500, 2000))
    fleet = Fleet(make_spec(replicas=2), profile, requests, SimOptions(drain_timeout_s=2.0), scripted([(5.0, 1)]))
    result = fleet.run()
    aborted = [r for r in result.records if r.status == "aborted"]
    assert aborted and all("killed at the end of its 2 s drain" in r.detail for r in aborted)
    assert result.conserved
    stopped = [p for p in fleet.pools["colocated"].pods if p.state == PodState.STOPPED]
    assert len(stopped) == 1 and stopped[0].stopped_at == pytest.approx(7.0)


def test_scale_down_cancels_starting_pods_first(profile) -> None:
    fleet = Fleet(
        make_spec(replicas=2), profile, poisson(200, 4.0), SimOptions(startup_s=30.0), scripted([(10.0, 3), (15.0, 2)])
    )
    fleet.run()
    pods = {p.name: p for p in fleet.pools["colocated"].pods}
    assert pods["colocated-3"].stopped_at == pytest.approx(15.0, abs=1.0)
    assert pods["colocated-3"].engine.scheduler.step_index == 0  # never served
    assert pods["colocated-1"].stopped_at is None and pods["colocated-2"].stopped_at is None


def test_the_router_holds_requests_while_no_pod_is_ready(profile) -> None:
    result = Fleet(make_spec(), profile, poisson(20, 2.0), SimOptions(startup_s=15.0, initial_pods_ready=False)).run()
    assert all(r.status == "finished" for r in result.records)
    assert min(r.dispatched_at for r in result.records) == pytest.approx(15.0)


class StubMetrics:
    def __init__(self, waiting: float, pods: int) -> None:
        self.waiting, self.pods = waiting, pods

    def measure(self, pool: PoolRef, window_s: float) -> PoolMetrics:
        return PoolMetrics(pool=pool, at=0.0, window_s=window_s, waiting=self.waiting, ready_pods=self.pods)


@pytest.mark.parametrize(
    ("waiting", "pods", "desired"),
    [(10.0, 2, 5), (4.1, 2, 2), (0.0, 2, 0), (100.0, 2, 6), (3.0, 1, 2)],
    ids=["ceil(waiting / target)", "within 10% tolerance", "no queue", "at most +4 or x2", "one pod"],
)
def test_hpa_recommendation(profile, waiting, pods, desired) -> None:
    fleet = Fleet(make_spec(replicas=pods), profile, [])
    fleet.metric_source = StubMetrics(waiting, pods)  # type: ignore[assignment]
    hpa = QueueLengthHPA(fleet, HPAConfig(target_waiting_per_pod=2.0))
    assert hpa.recommend("colocated", 0.0)[0] == desired


def test_hpa_scales_up_on_a_queue_and_down_after_its_window(profile) -> None:
    burst = PhasedWorkload(
        "b", phases=((120.0, 12.0), (400.0, 0.2)), prompt_len=(64, 256), output_len=(16, 64), output_mean=None
    )
    spec = make_spec(max_replicas=6, autotune={"scaleDownStabilizationSeconds": 120})
    result = simulate(spec, profile, burst.requests(), controller="hpa", hpa=HPAConfig(target_waiting_per_pod=1.0))
    moves = [(d.at, c["from"], c["to"]) for d in result.decisions for c in d.changes]
    ups = [m for m in moves if m[2] > m[1]]
    downs = [m for m in moves if m[2] < m[1]]
    assert ups and ups[0][0] < 120.0 and max(m[2] for m in ups) > 1
    # scale-down takes the highest recommendation of its 120 s window: not before a window after the last rise
    assert downs and min(m[0] for m in downs) >= max(m[0] for m in ups) + 120.0
    knobs = {tuple(p.pools["colocated"][k] for k in ("maxBatchSize", "batchTimeoutMs")) for p in result.timeline}
    assert len(knobs) == 1  # an HPA never moves the knobs
    assert max(direction_changes(result, 120.0).values()) <= 1


def test_disaggregated_pools(profile) -> None:
    spec = make_spec(mode="disaggregated", replicas=1)
    result = simulate(spec, profile, poisson(100, 3.0, output=(8, 64)), controller="fixed")
    assert result.conserved and all(r.status == "finished" for r in result.records)
    assert {r.pod.split("-")[0] for r in result.records} == {"decode"}
    assert all(len(r.token_times) == r.output_len for r in result.records)
    summary = summarize(result)
    assert set(summary["replica_minutes_by_pool"]) == {"prefill", "decode"}


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_pods_are_picked_as_the_router_and_the_front_pick_servers(profile, mode) -> None:
    """The router and the local fleet's front weigh a request yet to produce a token above one
    decoding (load_score): 3 decoding rank below 1 unstarted."""
    spec = make_spec(mode=mode, replicas=2)
    fleet = Fleet(spec, profile, [], SimOptions(startup_s=0.0))
    pool = fleet.pools["decode" if mode == "disaggregated" else "colocated"]
    decoding, starting = pool.pods
    for i in range(3):
        decoding.add(f"d{i}", 16, 8, 0.0)  # their first tokens came back: started
    starting.add("s", 16, 8, 0.0)
    starting.unstarted.add("s")
    assert fleet._pick(pool) is decoding


def test_a_disaggregated_client_gets_its_first_token_from_the_decode_pod(profile) -> None:
    # one decode slot: the second request's prompt is prefilled at once, but its client waits
    # for the slot (the real router relays the decode server's stream; the prefill server's one
    # token goes nowhere), and that wait is in the decode pool's TTFT, not the prefill pool's; so
    # is the KV fetch, which a decode server makes after the router's call
    spec = make_spec(mode="disaggregated", replicas=1, engine={"maxBatchSize": 1})
    requests = [RequestSpec(0.0, 64, 200), RequestSpec(0.0, 64, 200), RequestSpec(0.0, 1, 4)]
    fleet = Fleet(spec, profile, requests, SimOptions(kv_transfer_latency_s=0.3))
    first, second, tiny = fleet.run().records
    assert not any(pod.unstarted for pool in fleet.pools.values() for pod in pool.pods)
    assert all(len(r.token_times) == r.output_len for r in (first, second, tiny))
    assert second.token_times[0] > first.token_times[-1]
    prefill, decode = (fleet.pools[p].series for p in ("prefill", "decode"))
    second_s = prefill.histograms["ttft"].bounds.index(1.0)
    assert prefill.histograms["ttft"].cumulative()[second_s] == 2  # both prompts prefilled within a second
    assert decode.histograms["ttft"].cumulative()[second_s] == 2  # the decode server saw the wait
    assert second.ttft > 3.0 and decode.histograms["ttft"].cumulative()[-1] == 3
    fetch_s = decode.histograms["ttft"].bounds.index(0.25)
    assert decode.histograms["ttft"].cumulative()[fetch_s] == 1  # only the one-token prompt fetched nothing
    # the prefill server computes all but the last prompt token; a one-token prompt skips it
    assert prefill.counters["prompt_tokens"] == 2 * 63


def test_report_per_minute_and_warm_up(profile) -> None:
    requests = poisson(600, 5.0)  # two minutes
    result = simulate(make_spec(), profile, requests, controller="fixed", measure_from=60.0)
    minutes = per_minute(result)
    assert len(minutes) == math.ceil((requests[-1].arrival_s - 60.0) / 60.0)
    assert sum(m["arrivals"] for m in minutes) == sum(1 for r in requests if r.arrival_s >= 60.0)
    summary = summarize(result)
    assert summary["requests"] == minutes[0]["arrivals"] + sum(m["arrivals"] for m in minutes[1:])
    assert summary["replica_minutes"] == pytest.approx((result.end - 60.0) / 60.0)


def test_pods_ready_at_once_take_the_requests_waiting_for_a_pod(profile) -> None:
    # --startup-s 0: a scale-up from none must still serve what the router held
    spec = make_spec(replicas=0, min_replicas=0)
    fleet = Fleet(spec, profile, poisson(20, 2.0), SimOptions(startup_s=0.0), scripted([(12.0, 1)]))
    result = fleet.run()
    assert all(r.status == "finished" for r in result.records)
    assert min(r.dispatched_at for r in result.records) == pytest.approx(12.0, abs=1.0)


def test_the_last_minute_judges_the_gaps_streamed_after_it(profile) -> None:
    # every request arrives at the first minute's end and streams after it: its gaps still count
    late = [RequestSpec(59.999, 64, 400) for _ in range(8)]
    result = simulate(make_spec(itl_ms=1), profile, late, controller="fixed")  # an ITL SLO nothing meets
    (minute,) = per_minute(result)
    assert minute["itl_p95_s"] > 0.001 and minute["met"] is False
    assert max(r.token_times[-1] for r in result.records) > 60.0


def test_goodput_of_a_trace_that_arrives_at_once_is_per_second_of_the_run(profile) -> None:
    result = simulate(make_spec(), profile, [RequestSpec(0.0, 32, 8) for _ in range(3)], controller="fixed")
    summary = summarize(result)
    assert summary["good_requests"] == 3
    assert summary["goodput_req_s"] == pytest.approx(3 / result.end)


def test_the_plot_counts_minutes_from_the_warm_ups_end_on_every_panel(profile, tmp_path, monkeypatch) -> None:
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at
    result = simulate(make_spec(), profile, poisson(600, 5.0), controller="fixed", measure_from=60.0)
    save_plot(result, tmp_path / "run.png")
    latency, replicas = figures[0].axes[:2]
    assert latency.lines[0].get_xdata()[0] == 0.5  # the first measured minute's middle
    assert min(replicas.lines[0].get_xdata()) == pytest.approx(-1.0)  # the pods from t=0: a minute before it


def test_a_prefill_pod_refuses_what_its_decode_pod_would(profile) -> None:
    # 4000 prompt tokens fit builtin:small's 4096 positions, 4000 + 200 do not: the real prefill
    # server checks the client's max_tokens (server/openai/submission.py), not its own one token
    spec = make_spec(mode="disaggregated", replicas=1)
    result = simulate(spec, profile, [RequestSpec(0.0, 4000, 200), RequestSpec(1.0, 64, 8)], controller="fixed")
    long, short = result.records
    assert long.status == "rejected" and long.detail.startswith("400 from prefill-1: 'max_tokens'")
    assert not long.token_times  # never prefilled: no first token, no KV moved
    assert short.status == "finished"
    assert per_minute(result)[0]["met"] is False


def test_a_pools_max_model_len_limits_its_pods(profile) -> None:
    spec = make_spec(engine={"maxModelLen": 256})
    result = simulate(spec, profile, [RequestSpec(0.0, 500, 10), RequestSpec(0.5, 200, 10)], controller="fixed")
    assert [r.status for r in result.records] == ["rejected", "finished"]
    assert "maximum context length is 256 tokens" in result.records[0].detail


def test_a_max_model_len_past_the_models_is_refused_before_anything_runs(profile) -> None:
    spec = make_spec(engine={"maxModelLen": 8192}, replicas=0, min_replicas=0)  # no pod at the start: still refused
    with pytest.raises(PodConfigError, match=r"pool colocated: engine.maxModelLen 8192 exceeds the model's limit 4096"):
        Fleet(spec, profile, [RequestSpec(0.0, 10, 10)])


def test_a_prompt_far_past_the_context_is_refused_before_its_tokens_are_built(profile) -> None:
    result = simulate(make_spec(), profile, [RequestSpec(0.0, 10**11, 10)], controller="fixed")  # 800 GB as a list
    (record,) = result.records
    assert record.status == "rejected" and "your request has 100000000000 input tokens" in record.detail


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_an_idle_pool_goes_to_zero_and_the_next_requests_wait_out_its_cold_start(profile, mode) -> None:
    """The real tuner scales the idle pools to zero; the next arrivals wake them at once and wait
    at the router for the start-up delay; none is lost, and the report counts them."""
    burst = poisson(20, 2.0)
    later = [RequestSpec(600.0 + r.arrival_s, r.prompt_len, r.output_len) for r in poisson(20, 2.0, seed=1)]
    spec = make_spec(min_replicas=0, mode=mode, autotune={"scaleToZeroAfterSeconds": 60})
    result = simulate(spec, profile, burst + later, controller="tuner", options=SimOptions(startup_s=25.0))
    assert result.conserved and all(r.status == "finished" for r in result.records)
    to_zero = [c for d in result.decisions for c in d.changes if c["to"] == 0]
    assert {c["pool"] for c in to_zero} == set(spec.active_pools) and all(c["from"] == 1 for c in to_zero)
    assert all("idle for" in c["reason"] for c in to_zero)
    assert {c.pool for c in result.cold_starts} == set(spec.active_pools)
    assert all(
        c.seconds == pytest.approx(25.0) and c.at == pytest.approx(later[0].arrival_s) for c in result.cold_starts
    )
    held = [r for r in result.records if r.held_s > 0]
    assert held and all(r.arrival >= 600.0 for r in held) and max(r.held_s for r in held) <= 25.0 + 1e-6
    summary = summarize(result)
    assert summary["cold_starts"] == len(spec.active_pools) and summary["held_requests"] == len(held)
    assert summary["cold_start_max_s"] == pytest.approx(25.0)
    zero_at = min(d.at for d in result.decisions if any(c["to"] == 0 for c in d.changes))
    assert 60.0 <= zero_at - burst[-1].arrival_s < 120.0  # idle for scaleToZeroAfterSeconds, give or take a run
