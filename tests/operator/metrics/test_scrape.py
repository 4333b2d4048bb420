"""ScrapeSource against canned /metrics texts at successive times: windowed rates and quantiles
from bucket deltas, counter resets, pods appearing and disappearing, failed scrapes."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llmfleet.operator.metrics.quantile import bucket_quantile
from llmfleet.operator.metrics.scrape import ScrapeSource, parse_exposition
from llmfleet.operator.metrics.source import PoolRef, StalenessPolicy

REF = PoolRef("local", "fleet", "colocated")
LABELS = 'model_name="m",role="colocated"'
T0 = 1_700_000_000.0
BOUNDS = [0.01, 0.05, 0.1, 0.5, 1.0, math.inf]
SIZES = [50.0, 100.0, 200.0, 500.0, math.inf]  # tokens, for the prompt-length histogram


@dataclass
class Pod:
    """One pod's metric state, rendered as prometheus_client renders it (with _created series)."""

    created: float = T0 - 1000.0
    prompt: float = 0.0
    generation: float = 0.0
    success: dict[str, float] = field(default_factory=lambda: {"stop": 0.0, "length": 0.0})
    preemptions: float = 0.0
    waiting: float = 0.0
    running: float = 0.0
    kv: float = 0.0
    ttft: list[float] = field(default_factory=list)  # observations so far
    itl: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)
    batches: list[float] = field(default_factory=list)
    prompts: list[float] = field(default_factory=list)  # each finished request's prompt length

    def render(self) -> str:
        out: list[str] = []

        def counter(name: str, values: dict[str, float] | float, extra: str = "") -> None:
            out.append(f"# HELP {name}_total x\n# TYPE {name}_total counter")
            items = values.items() if isinstance(values, dict) else [("", values)]
            for label, value in items:
                labels = LABELS + (f',{extra}="{label}"' if extra else "")
                out.append(f"{name}_total{{{labels}}} {value}")
            out.append(f"# HELP {name}_created x\n# TYPE {name}_created gauge")
            out.append(f"{name}_created{{{LABELS}}} {self.created}")

        def gauge(name: str, value: float) -> None:
            out.append(f"# HELP {name} x\n# TYPE {name} gauge\n{name}{{{LABELS}}} {value}")

        def histogram(name: str, observations: list[float], bounds: list[float] = BOUNDS) -> None:
            if not observations:
                return  # prometheus_client creates a labelled child on its first observation
            out.append(f"# HELP {name} x\n# TYPE {name} histogram")
            for bound in bounds:
                le = "+Inf" if bound == math.inf else repr(bound)
                count = sum(1 for o in observations if o <= bound)
                out.append(f'{name}_bucket{{le="{le}",{LABELS}}} {float(count)}')
            out.append(f"{name}_count{{{LABELS}}} {float(len(observations))}")
            out.append(f"{name}_sum{{{LABELS}}} {sum(observations)}")
            out.append(
                f"# HELP {name}_created x\n# TYPE {name}_created gauge\n{name}_created{{{LABELS}}} {self.created}"
            )

        counter("vllm:prompt_tokens", self.prompt)
        counter("vllm:generation_tokens", self.generation)
        counter("vllm:request_success", self.success, "finished_reason")
        counter("vllm:num_preemptions", self.preemptions)
        gauge("vllm:num_requests_waiting", self.waiting)
        gauge("vllm:num_requests_running", self.running)
        gauge("vllm:kv_cache_usage_perc", self.kv)
        histogram("vllm:time_to_first_token_seconds", self.ttft)
        histogram("vllm:inter_token_latency_seconds", self.itl)
        histogram("vllm:request_queue_time_seconds", self.queue)
        histogram("llmfleet_batch_size", self.batches)
        histogram("vllm:request_prompt_tokens", self.prompts, SIZES)
        return "\n".join(out) + "\n"

    def serve(self, requests: int, prompt_len: float, ttft: float, itl: float, tokens_each: int) -> None:
        """Advance: `requests` finish, each with one TTFT and `tokens_each` ITL observations."""
        self.prompt += requests * prompt_len
        self.generation += requests * tokens_each
        self.success["stop"] += requests
        self.prompts += [prompt_len] * requests
        self.ttft += [ttft] * requests
        self.queue += [ttft / 10] * requests
        self.itl += [itl] * (requests * tokens_each)
        self.batches += [8.0] * (requests * tokens_each // 8)


class Fleet:
    """Serves each pod's current text at its URL; a pod set to an int answers that HTTP status,
    one set to a str answers that body."""

    def __init__(self) -> None:
        self.pods: dict[str, Pod | int | str] = {}
        self.now = T0

    def clock(self) -> float:
        return self.now

    def handler(self, request: httpx.Request) -> httpx.Response:
        pod = self.pods.get(str(request.url))
        if pod is None:
            raise httpx.ConnectError("no such pod", request=request)
        if isinstance(pod, int):
            return httpx.Response(pod, text="boom")
        if isinstance(pod, str):
            return httpx.Response(200, text=pod)
        return httpx.Response(200, text=pod.render())

    def source(self, **kw) -> ScrapeSource:
        client = httpx.AsyncClient(transport=httpx.MockTransport(self.handler))
        return ScrapeSource(lambda ref: list(self.pods), client=client, clock=self.clock, **kw)


A, B, C = "http://10.0.0.1:8000/metrics", "http://10.0.0.2:8000/metrics", "http://10.0.0.3:8000/metrics"


def warm(pod: Pod) -> Pod:
    pod.serve(requests=50, prompt_len=100, ttft=0.2, itl=0.02, tokens_each=20)
    return pod


async def test_first_snapshot_is_stale_then_rates_and_quantiles_over_the_window() -> None:
    fleet = Fleet()
    fleet.pods = {A: warm(Pod(waiting=2, running=8, kv=0.2)), B: warm(Pod(waiting=0, running=4, kv=0.4))}
    src = fleet.source()
    first = await src.snapshot(REF, 60)
    assert first.stale and first.reason == "colocated: first scrape of every pod; rates need an earlier scrape"

    fleet.now += 30
    a, b = fleet.pods[A], fleet.pods[B]
    assert isinstance(a, Pod) and isinstance(b, Pod)
    a.serve(requests=30, prompt_len=200, ttft=0.3, itl=0.04, tokens_each=10)  # 30 TTFTs in (0.1, 0.5]
    b.serve(requests=10, prompt_len=200, ttft=0.04, itl=0.004, tokens_each=10)  # 10 TTFTs in (0.01, 0.05]
    a.waiting, a.kv = 4, 0.6
    m = await src.snapshot(REF, 60)

    assert not m.stale, m.reason
    assert m.ready_pods == 2 and m.newest_sample_age_s == 0.0
    assert m.request_rate == pytest.approx(40 / 30)
    assert m.prompt_tokens_per_s == pytest.approx(40 * 200 / 30)
    assert m.generation_tokens_per_s == pytest.approx(400 / 30)
    assert m.preemptions_per_s == 0.0  # a measured zero
    # quantiles of the window only (the 100 earlier observations at 0.2 s are not in it)
    window = {0.01: 0, 0.05: 10, 0.1: 10, 0.5: 40, 1.0: 40, math.inf: 40}
    assert m.ttft.samples == 40
    assert m.ttft.p95 == pytest.approx(bucket_quantile(0.95, window))
    assert m.ttft.p50 == pytest.approx(0.1 + 0.4 * (10 / 30))
    assert m.itl.samples == 400 and m.itl.p95 is not None and m.itl.p95 <= 0.05
    assert [q for q, _ in m.itl.between] == [0.96, 0.97, 0.98]  # ITL's tail, as Prometheus's source reads it
    assert m.mean_batch_size == pytest.approx(8.0)
    # the prompts of the requests finished in the window, not of the 100 before
    assert m.prompt_tokens_per_request == pytest.approx(200.0)
    assert m.prompt_length.p95 == pytest.approx(bucket_quantile(0.95, {100: 0, 200: 40, 500: 40, math.inf: 40}))
    # gauges: each pod's mean over its scrapes in the window, summed (queues) or averaged (KV)
    assert m.waiting == pytest.approx((2 + 4) / 2 + 0)
    assert m.waiting_growth_per_s == pytest.approx(2 / 30)  # pod A's queue rose 2 -> 4 in 30 s
    assert m.running == pytest.approx(12)
    assert m.kv_usage_max == pytest.approx(0.6)
    assert m.kv_usage_mean == pytest.approx(((0.2 + 0.6) / 2 + 0.4) / 2)
    assert m.missing["mean_step_tokens"] == "mean_step_tokens: no series vllm:iteration_tokens_total"


async def test_baseline_is_the_scrape_closest_to_the_window() -> None:
    fleet = Fleet()
    fleet.pods = {A: warm(Pod())}
    src = fleet.source()
    for _ in range(4):  # scrapes at T0, +20, +40, +60
        await src.snapshot(REF, 40)
        fleet.now += 20
        pod = fleet.pods[A]
        assert isinstance(pod, Pod)
        pod.serve(requests=20, prompt_len=10, ttft=0.2, itl=0.02, tokens_each=1)
    m = await src.snapshot(REF, 40)  # at +80: the baseline is the scrape at +40
    assert m.request_rate == pytest.approx(40 / 40)


async def test_a_run_reads_two_windows_from_one_scrape_and_keeps_history_for_the_longer() -> None:
    """The tuner reads the metric window (30 s) and the SLO's (60 s) each run: one scrape per pod
    serves both, and the 30 s reads do not trim away the 60 s baseline."""
    fleet = Fleet()
    fleet.pods = {A: warm(Pod())}
    scrapes: list[float] = []
    handler = fleet.handler
    fleet.handler = lambda request: scrapes.append(fleet.now) or handler(request)  # type: ignore[method-assign]
    src = fleet.source()
    for _ in range(7):  # runs at T0, +10, ..., +60
        await src.snapshot(REF, 30)
        await src.snapshot(REF, 60)
        fleet.now += 10
        pod = fleet.pods[A]
        assert isinstance(pod, Pod)
        pod.serve(requests=10, prompt_len=10, ttft=0.2, itl=0.02, tokens_each=1)
    short, long = await src.snapshot(REF, 30), await src.snapshot(REF, 60)  # at +70
    assert len(scrapes) == 8  # one per run
    assert short.request_rate == pytest.approx(30 / 30) and short.ttft.samples == 30
    assert long.request_rate == pytest.approx(60 / 60) and long.ttft.samples == 60


async def test_counter_reset_counts_from_zero() -> None:
    fleet = Fleet()
    fleet.pods = {A: warm(Pod())}
    src = fleet.source()
    await src.snapshot(REF, 60)
    fleet.now += 30
    restarted = Pod(created=fleet.now - 10)  # the process restarted 10 s ago
    restarted.serve(requests=6, prompt_len=100, ttft=0.2, itl=0.02, tokens_each=5)
    fleet.pods[A] = restarted
    m = await src.snapshot(REF, 60)
    assert m.request_rate == pytest.approx(6 / 30)
    assert m.ttft.samples == 6


async def test_a_lower_counter_is_a_reset_even_without_created() -> None:
    fleet = Fleet()
    fleet.pods = {A: warm(Pod())}
    src = fleet.source()
    await src.snapshot(REF, 60)
    fleet.now += 30
    pod = Pod()  # same creation time, lower counters (e.g. created series disabled)
    pod.serve(requests=3, prompt_len=100, ttft=0.2, itl=0.02, tokens_each=5)
    fleet.pods[A] = pod
    m = await src.snapshot(REF, 60)
    assert m.request_rate == pytest.approx(3 / 30)


async def test_a_restart_keeps_what_the_pod_counted_before_it() -> None:
    """Each step between kept scrapes is judged alone: a restart mid-window loses nothing before it."""
    fleet = Fleet()
    pod = warm(Pod())
    fleet.pods = {A: pod}
    src = fleet.source()
    await src.snapshot(REF, 60)
    for _ in range(5):  # 10 requests every 10 s, slow
        fleet.now += 10
        pod.serve(requests=10, prompt_len=100, ttft=0.8, itl=0.02, tokens_each=5)
        await src.snapshot(REF, 60)
    fleet.now += 10
    restarted = Pod(created=fleet.now - 5)
    restarted.serve(requests=5, prompt_len=100, ttft=0.04, itl=0.02, tokens_each=5)
    fleet.pods[A] = restarted
    m = await src.snapshot(REF, 60)
    assert m.request_rate == pytest.approx(55 / 60)
    assert m.prompt_tokens_per_s == pytest.approx(5500 / 60)
    assert m.ttft.samples == 55
    assert m.ttft.p95 == pytest.approx(bucket_quantile(0.95, {0.05: 5, 0.1: 5, 0.5: 5, 1.0: 55, math.inf: 55}))


async def test_new_pods_count_from_their_creation_or_are_covered_by_the_others() -> None:
    fleet = Fleet()
    fleet.pods = {A: warm(Pod())}
    src = fleet.source()
    await src.snapshot(REF, 60)
    fleet.now += 30
    fleet.pods[A].serve(requests=30, prompt_len=100, ttft=0.2, itl=0.02, tokens_each=5)  # type: ignore[union-attr]
    young = Pod(created=fleet.now - 20)  # started inside the window: its whole life counts
    young.serve(requests=10, prompt_len=100, ttft=0.2, itl=0.02, tokens_each=5)
    old = warm(Pod(created=T0 - 5000))  # long-lived but never scraped: no baseline yet
    fleet.pods |= {B: young, C: old}
    m = await src.snapshot(REF, 60)
    assert not m.stale and m.ready_pods == 3
    assert m.request_rate == pytest.approx((30 / 30 + 10 / 20) * 3 / 2)  # C as the mean of A and B
    assert m.missing["coverage"] == "1 pod(s) first seen now: rates scaled from the 2 counted"
    assert m.ttft.samples == 40  # quantiles from the observations there are, unscaled
    fleet.now += 30
    m = await src.snapshot(REF, 60)
    assert "coverage" not in m.missing


async def test_vanished_pods_count_until_their_scrapes_leave_the_window() -> None:
    fleet = Fleet()
    fleet.pods = {A: warm(Pod()), B: warm(Pod())}
    src = fleet.source()
    await src.snapshot(REF, 60)
    fleet.now += 30
    for pod in fleet.pods.values():
        pod.serve(requests=30, prompt_len=100, ttft=0.2, itl=0.02, tokens_each=5)  # type: ignore[union-attr]
    await src.snapshot(REF, 60)
    del fleet.pods[B]  # scaled down: A takes B's share
    fleet.now += 30
    fleet.pods[A].serve(requests=60, prompt_len=100, ttft=0.2, itl=0.02, tokens_each=5)  # type: ignore[union-attr]
    m = await src.snapshot(REF, 60)
    assert m.ready_pods == 1 and not m.stale and "coverage" not in m.missing
    assert m.request_rate == pytest.approx(120 / 60)  # the pool served 2/s throughout
    assert m.ttft.samples == 120
    fleet.now += 150
    await src.snapshot(REF, 60)
    assert set(src._history[REF]) == {A}


async def test_failed_pods_are_covered_by_those_that_answered() -> None:
    fleet = Fleet()
    fleet.pods = {A: warm(Pod()), B: warm(Pod())}
    src = fleet.source()
    await src.snapshot(REF, 60)
    fleet.now += 30
    fleet.pods[A].serve(requests=30, prompt_len=100, ttft=0.2, itl=0.02, tokens_each=5)  # type: ignore[union-attr]
    fleet.pods[A].waiting = 3  # type: ignore[union-attr]
    fleet.pods[B] = 500  # too busy to answer: its share is not read as zero
    m = await src.snapshot(REF, 60)
    assert not m.stale and m.ready_pods == 2
    assert m.request_rate == pytest.approx(2.0)
    assert m.waiting == pytest.approx(2 * (0 + 3) / 2)  # A's mean over its scrapes, for both
    assert m.missing["coverage"] == "1 pod(s) failed to answer: rates scaled from the 1 counted"

    fleet.pods = {A: 503, B: 500}
    fleet.now += 30
    m = await src.snapshot(REF, 60)
    assert m.stale and m.reason.startswith("colocated: no pod answered")

    fleet.pods = {A: warm(Pod()), B: 500, C: 500}
    m = await fleet.source(min_reporting_fraction=0.5).snapshot(REF, 60)
    assert m.stale and "only 1 of 3 pods answered" in m.reason


async def test_history_covers_a_long_slo_window_at_a_short_interval() -> None:
    fleet = Fleet()
    pod = warm(Pod())
    fleet.pods = {A: pod}
    src = fleet.source()
    await src.snapshot(REF, 600)
    for _ in range(120):  # every 5 s for 600 s: 1 request/s
        fleet.now += 5
        pod.serve(requests=5, prompt_len=100, ttft=0.2, itl=0.02, tokens_each=5)
        m = await src.snapshot(REF, 600)
    assert m.ttft.samples == 600 and m.request_rate == pytest.approx(1.0)


async def test_a_malformed_exposition_is_a_failed_scrape() -> None:
    fleet = Fleet()
    fleet.pods = {A: warm(Pod()), B: warm(Pod())}
    src = fleet.source()
    await src.snapshot(REF, 60)
    fleet.now += 30
    fleet.pods[B] = fleet.pods[B].render().replace('le="0.01",', "")  # type: ignore[union-attr]
    m = await src.snapshot(REF, 60)
    assert not m.stale and "1 pod(s) failed to answer" in m.missing["coverage"]


async def test_no_targets_is_stale() -> None:
    src = ScrapeSource({}, client=httpx.AsyncClient(), clock=lambda: T0)
    m = await src.snapshot(REF, 60)
    assert m.stale and m.reason == "colocated: no pods to scrape"


async def test_quiet_window_reports_missing_quantiles() -> None:
    fleet = Fleet()
    fleet.pods = {A: warm(Pod())}
    src = fleet.source(policy=StalenessPolicy(min_samples=20))
    await src.snapshot(REF, 60)
    fleet.now += 30
    pod = fleet.pods[A]
    assert isinstance(pod, Pod)
    pod.serve(requests=3, prompt_len=10, ttft=0.2, itl=0.02, tokens_each=1)
    m = await src.snapshot(REF, 60)
    assert m.ttft.p95 is None and m.ttft.samples == 3
    assert m.missing["ttft"] == "ttft: 3 observations in the 60 s window (< 20)"
    assert m.request_rate == pytest.approx(0.1)


def test_parses_real_prometheus_client_output() -> None:
    registry = CollectorRegistry()
    labels = ["model_name", "role"]
    Counter("vllm:prompt_tokens", "x", labels, registry=registry).labels("m", "decode").inc(7)
    Gauge("vllm:num_requests_waiting", "x", labels, registry=registry).labels("m", "decode").set(3)
    hist = Histogram("vllm:iteration_tokens_total", "x", labels, buckets=[1, 8], registry=registry)
    hist.labels("m", "decode").observe(5)
    scrape = parse_exposition(generate_latest(registry).decode(), at=T0)
    assert scrape.counters["vllm:prompt_tokens_total"] == 7
    assert scrape.gauges["vllm:num_requests_waiting"] == 3
    assert scrape.buckets["vllm:iteration_tokens_total"] == {1.0: 0.0, 8.0: 1.0, math.inf: 1.0}
    assert scrape.counters["vllm:iteration_tokens_total_sum"] == 5
    assert set(scrape.created) >= {"vllm:prompt_tokens", "vllm:iteration_tokens_total"}


@contextlib.asynccontextmanager
async def serving(registry: CollectorRegistry) -> AsyncIterator[str]:
    """``registry``'s exposition served over loopback HTTP, as a pod's: its /metrics URL."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        await runner.cleanup()


async def test_real_http_scrape_on_loopback() -> None:
    """Two real scrapes of a real exposition served over loopback HTTP."""
    registry = CollectorRegistry()
    labels = ["model_name", "role"]
    prompt = Counter("vllm:prompt_tokens", "x", labels, registry=registry).labels("m", "colocated")
    ttft = Histogram("vllm:time_to_first_token_seconds", "x", labels, buckets=[0.1, 1.0], registry=registry)
    Gauge("vllm:num_requests_running", "x", labels, registry=registry).labels("m", "colocated").set(2)
    async with serving(registry) as url:
        src = ScrapeSource({REF: [url]}, min_gap_s=0.0, policy=StalenessPolicy(min_samples=1))
        try:
            first = await src.snapshot(REF, 30)  # the server started inside the window: counts from its start
            assert not first.stale and first.prompt_tokens_per_s == 0.0
            prompt.inc(100)
            for _ in range(4):
                ttft.labels("m", "colocated").observe(0.05)
            m = await src.snapshot(REF, 30)
        finally:
            await src.aclose()
    assert not m.stale, m.reason
    assert m.prompt_tokens_per_s is not None and m.prompt_tokens_per_s > 0
    assert m.ttft.samples == 4 and m.ttft.p95 == pytest.approx(0.095)
    assert m.running == 2


async def test_a_routers_exposition_gives_the_ttft_its_clients_saw() -> None:
    """The router exports vLLM's latency histograms under role="router" and no engine gauges: its
    TTFT quantiles come through (what status shows a disaggregated fleet's clients waited)."""
    from llmfleet.server.router.router_metrics import RouterMetrics

    router = RouterMetrics("pd")
    ref = PoolRef("default", "svc", "router")
    async with serving(router.registry) as url:
        src = ScrapeSource({ref: [url]}, min_gap_s=0.0)
        try:
            await src.snapshot(ref, 30)
            for _ in range(40):
                router.lab(router.ttft).observe(0.3)
            m = await src.snapshot(ref, 30)
        finally:
            await src.aclose()
    assert m.ttft.samples == 40 and 0.25 < m.ttft.p95 <= 0.5
    assert m.running is None and m.waiting is None  # no gauges: nothing to read as zero
