"""The whole measuring path for real: a Prometheus (the Debian package) scrapes real server
processes under load, the tuner reads the quantiles from it through PromQL, and its knob change
reaches the servers through their config file, which they apply live."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import yaml

from llmfleet.operator.metrics.prometheus import PrometheusSource
from llmfleet.operator.metrics.source import PoolRef
from llmfleet.operator.resource.spec import parse_spec
from llmfleet.operator.resource.tuner_state import TunerState, effective_engine
from llmfleet.operator.tuner.run import Autotuner, PoolView, views_from_state
from tests.prometheus_support import PrometheusProcess, TargetGroup, require_prometheus
from tests.support import ServerProcess

pytestmark = pytest.mark.prometheus

# An ITL SLO no CPU can meet: the tuner must shrink the batch, whatever this machine's speed.
SPEC = parse_spec(
    {
        "model": {"builtin": "tiny"},
        "slo": {"ttftP95Ms": 60000, "itlP95Ms": 0.01},
        "pools": {"colocated": {"engine": {"maxBatchSize": 16, "kvCacheMemoryMb": 64}}},
        "autotune": {"intervalSeconds": 5, "cooldownSeconds": 0},
    }
)
REF = PoolRef("test", "tiny", "colocated")


class ConfigFileActuator:
    """The pool's engine.yaml, as the local fleet writes it."""

    def __init__(self, path) -> None:
        self.path = path
        self.state = TunerState()
        self.write()

    def write(self) -> None:
        self.path.write_text(effective_engine(SPEC, "colocated", self.state).to_yaml())

    def observe(self) -> dict[str, PoolView]:
        return views_from_state(SPEC, self.state)

    def apply(self, pool: str, replicas: int | None, knobs: dict[str, float]) -> None:
        self.state.knobs[pool] = {**self.state.knobs.get(pool, {}), **knobs}
        self.write()


async def _load(url: str, seconds: float, streams: int = 6) -> None:
    deadline = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            body = {"model": "tiny", "prompt": "measure me", "max_tokens": 24, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for _ in response.aiter_lines():
                    pass

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        await asyncio.gather(*(client(http) for _ in range(streams)))


def _knob(server: ServerProcess, name: str) -> float:
    return next(v for k, v in server.metrics().items() if k == f"llmfleet_config_knob{{knob={name}}}")


@pytest.mark.timed
def test_the_tuner_reads_prometheus_and_the_servers_apply_its_knob(tmp_path):
    require_prometheus()
    config = tmp_path / "engine.yaml"
    actuator = ConfigFileActuator(config)
    with ServerProcess("--model", "builtin:tiny", "--served-model-name", "tiny", config=config) as server:
        labels = {"namespace": REF.namespace, "inference_service": REF.inference_service, "pool": REF.pool}
        target = TargetGroup([server.url.removeprefix("http://")], labels)
        with PrometheusProcess([target]) as prometheus:
            prometheus.wait_for('up{pool="colocated"} == 1', timeout=30)
            asyncio.run(_load(server.url, seconds=12))
            time.sleep(3)  # the last scrape after the load

            async def one_run():
                source = PrometheusSource(prometheus.url)
                try:
                    return await Autotuner(SPEC, source, {"colocated": REF}).step(actuator, time.time())
                finally:
                    await source.aclose()

            outcome = asyncio.run(one_run())
            assert not outcome.decision.hold, outcome.decision.hold_reason
            m = outcome.metrics["colocated"]
            assert m.itl.p95 is not None and m.itl.samples >= 20 and m.generation_tokens_per_s > 0
            change = outcome.decision.changed("colocated", "maxBatchSize")
            assert change is not None and change.new < change.old == 16, outcome.decision.reasons
            assert yaml.safe_load(config.read_text())["max_batch_size"] == change.new

            deadline = time.monotonic() + 20
            while _knob(server, "max_batch_size") != change.new:
                assert time.monotonic() < deadline, "the server did not apply the tuner's knob"
                time.sleep(0.3)
