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

from llmfleet.operator.metrics_source import MetricSource, PoolMetrics, PoolRef
from llmfleet.operator.reconcile import TunerState, effective_engine
from llmfleet.operator.spec import InferenceServiceSpec
from llmfleet.operator.tuner import Decision, PoolInput, PoolLimits, PoolSettings, SLOTargets, Tuner, TunerConfig
from llmfleet.operator.tuner_memory import TunerMemory

from .pools import LocalPool
from .processes import ServerProcess

log = logging.getLogger(__name__)
NAMESPACE = "local"


def tuner_config(spec: InferenceServiceSpec) -> TunerConfig:
    """The tuner's timing from the spec's autotune section (HPA-like behaviour)."""
    a = spec.autotune
    return TunerConfig(
        scale_up_stabilization_s=float(a.scale_up_stabilization_seconds),
        scale_down_stabilization_s=float(a.scale_down_stabilization_seconds),
        cooldown_s=float(a.cooldown_seconds),
        headroom=float(a.headroom),
        knob_relax_stabilization_s=float(min(a.cooldown_seconds, a.scale_down_stabilization_seconds)),
        flap_window_s=float(a.scale_down_stabilization_seconds),
    )


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
        self.tuner = Tuner(tuner_config(spec))
        self.memory = TunerMemory()
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
        """One tuner run: measure every pool, decide, apply. Returns the decision."""
        self._next_tune = time.monotonic() + self.spec.autotune.interval_seconds
        window = float(max(30, 3 * self.spec.autotune.interval_seconds))
        inputs = {}
        for name, pool in self.pools.items():
            metrics = await source.snapshot(self.pool_ref(name), window)
            self.view.last_metrics[name] = metrics
            engine = effective_engine(self.spec, name, self.tuner_state)
            current = PoolSettings.from_engine(pool.replicas, engine)
            inputs[name] = PoolInput(metrics, current, PoolLimits.from_spec(self.spec.pool(name)))
        decision = self.tuner.decide(inputs, SLOTargets.from_spec(self.spec.slo), self.memory, time.time())
        self.memory = decision.memory
        self.apply(decision)
        self.view.last_decision = decision
        for change in decision.changes:
            self._note(f"{change}: {change.reason}")
        if decision.hold:
            log.info("tuner holds: %s", decision.hold_reason)
        return decision

    def apply(self, decision: Decision) -> None:
        """The decision's settings become the tuner state; configs and replica counts follow."""
        for name, settings in decision.settings.items():
            self.tuner_state.replicas[name] = settings.replicas
            self.tuner_state.knobs[name] = dict(settings.knobs)
        for pool in self.pools.values():
            if pool.write_config(self.tuner_state):
                log.info("%s: wrote %s", pool.name, pool.config_path)
            wanted = pool.desired_replicas(self.tuner_state)
            if wanted != pool.replicas:
                pool.scale_to(wanted)

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
