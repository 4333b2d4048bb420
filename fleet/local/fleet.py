"""The local fleet: an InferenceService run as processes on this machine.

It does what the operator and Kubernetes do in a cluster, with the same code where it can: the
spec model and `effective_engine` (operator/) render each pool's engine.yaml, the tuner law
(operator/tuner.py) decides from the pods' metrics (direct scrape, or a Prometheus), and its
decision lands as a config-file write (knobs, applied live) or as processes started and drained
(replicas). The client-facing endpoint is the router (disaggregated) or a small front
(colocated), on one port.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from llmfleet.operator.autotune import Autotuner, PoolView, views_from_state
from llmfleet.operator.metrics_source import MetricSource, PoolMetrics, PoolRef
from llmfleet.operator.reconcile import TunerState
from llmfleet.operator.spec import InferenceServiceSpec
from llmfleet.operator.tuner import Decision

from .pools import LocalPool
from .processes import ServerProcess

log = logging.getLogger(__name__)
NAMESPACE = "local"


@dataclass
class FleetView:
    """What the terminal view and the log show."""

    last_decision: Decision | None = None
    last_metrics: dict[str, PoolMetrics] = field(default_factory=dict)
    history: list[str] = field(default_factory=list)  # one line per change or event, newest last


class LocalFleet:
    def __init__(self, name: str, spec: InferenceServiceSpec, run_dir: Path, port: int) -> None:
        self.name = name
        self.spec = spec
        self.run_dir = run_dir
        self.port = port
        self.pools = {p: LocalPool(p, spec, name, run_dir) for p in spec.active_pools}
        self.tuner_state = TunerState()
        self.autotuner: Autotuner | None = None
        self.router: ServerProcess | None = None
        self.endpoints_file = run_dir / "endpoints.yaml"
        self.view = FleetView()
        self._next_tune = time.monotonic() + spec.autotune.interval_seconds

    # -- life cycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for pool in self.pools.values():
            pool.write_config(self.tuner_state)
            pool.scale_to(pool.desired_replicas(self.tuner_state))
        if self.spec.mode == "disaggregated":
            self._write_endpoints()
            args = ["--role", "router", "--served-model-name", self.spec.model.name or self.name,
                    "--model", self.spec.model.server_arg, "--endpoints-file", str(self.endpoints_file),
                    "--router-policy", self.spec.router.policy]  # fmt: skip
            self.router = ServerProcess(f"{self.name}-router", args, self.run_dir / "router.log", port=self.port)

    def processes(self) -> list[ServerProcess]:
        found = [p for pool in self.pools.values() for p in pool.all_processes()]
        return found + ([self.router] if self.router else [])

    def ready_backends(self) -> list[str]:
        """Where the colocated front sends requests."""
        return self.pools["colocated"].ready_urls() if "colocated" in self.pools else []

    def stop(self, timeout: float) -> None:
        """Drain every server (each finishes its streams), then kill what is left after ``timeout``."""
        for server in self.processes():
            server.drain()
        deadline = time.monotonic() + timeout
        while any(s.alive for s in self.processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        for server in self.processes():
            server.kill()

    # -- the control loop -----------------------------------------------------------------------

    def pool_ref(self, pool: str) -> PoolRef:
        return PoolRef(NAMESPACE, self.name, pool)

    def scrape_targets(self, ref: PoolRef) -> list[str]:
        pool = self.pools.get(ref.pool)
        return [f"{url}/metrics" for url in pool.ready_urls()] if pool else []

    def supervise(self) -> None:
        """Reap drained and crashed servers, keep the router's endpoints current."""
        for pool in self.pools.values():
            for note in pool.reap():
                self._note(f"{pool.name}: {note}")
        if self.spec.mode == "disaggregated":
            self._write_endpoints()

    def tune_due(self) -> bool:
        return self.spec.autotune.enabled and time.monotonic() >= self._next_tune

    async def tune(self, source: MetricSource) -> Decision:
        """One tuner run (operator/autotune.py, as in the cluster): measure, decide, apply."""
        self._next_tune = time.monotonic() + self.spec.autotune.interval_seconds
        if self.autotuner is None:
            refs = {name: self.pool_ref(name) for name in self.pools}
            self.autotuner = Autotuner(self.spec, source, refs)
        outcome = await self.autotuner.step(_Actuator(self), time.time())
        self.view.last_metrics = outcome.metrics
        self.view.last_decision = outcome.decision
        for _, reason, message in outcome.events:
            if reason != "TunerHolding":
                self._note(message)
        if outcome.decision.hold:
            log.info("tuner holds: %s", outcome.decision.hold_reason)
        return outcome.decision

    def apply(self, pool: str, replicas: int | None, knobs: dict[str, float]) -> None:
        """The tuner's new values become the tuner state; the config file and the processes follow."""
        if replicas is not None:
            self.tuner_state.replicas[pool] = replicas
        if knobs:
            self.tuner_state.knobs[pool] = {**self.tuner_state.knobs.get(pool, {}), **knobs}
        local = self.pools[pool]
        if local.write_config(self.tuner_state):
            log.info("%s: wrote %s", pool, local.config_path)
        wanted = local.desired_replicas(self.tuner_state)
        if wanted != local.replicas:
            local.scale_to(wanted)

    def _write_endpoints(self) -> None:
        endpoints = {name: pool.ready_urls() for name, pool in self.pools.items()}
        text = yaml.safe_dump(endpoints)
        if not self.endpoints_file.exists() or self.endpoints_file.read_text() != text:
            tmp = self.endpoints_file.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(self.endpoints_file)

    def _note(self, line: str) -> None:
        log.info("%s", line)
        self.view.history.append(f"{time.strftime('%H:%M:%S')} {line}")
        del self.view.history[:-50]


class _Actuator:
    """The local fleet as the tuner sees it: state in memory, config files and processes."""

    def __init__(self, fleet: LocalFleet) -> None:
        self.fleet = fleet

    def observe(self) -> dict[str, PoolView]:
        return views_from_state(self.fleet.spec, self.fleet.tuner_state)

    def apply(self, pool: str, replicas: int | None, knobs: dict[str, float]) -> None:
        self.fleet.apply(pool, replicas, knobs)
