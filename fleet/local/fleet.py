"""The local fleet: an InferenceService run as processes on this machine.

It does what the operator and Kubernetes do in a cluster, with the same code where it can: the
spec model and `effective_engine` (operator/) render each pool's engine.yaml, the tuner law
(operator/tuner/law.py) decides from the pods' metrics (direct scrape, or a Prometheus), and its
decision lands as a config-file write (knobs, applied live) or as processes started and drained
(replicas). The client-facing endpoint is the router, in every mode, on one port: the same
`llm-fleet serve --role router` the operator deploys, finding the servers in an endpoints file the
fleet keeps current. A pool the tuner has scaled to zero comes back as soon as the router holds a
request for it (``held`` in its /load): the fleet starts a server at once, and the time until it
is ready is the cold start it reports.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from llmfleet.local.pools import LocalPool
from llmfleet.local.processes import START_ATTEMPTS, ServerProcess, StartFailed
from llmfleet.operator.metrics.source import MetricSource, PoolMetrics, PoolRef
from llmfleet.operator.reconcile.desired import POOL_LABEL, Owner, desired_objects
from llmfleet.operator.resource.spec import InferenceServiceSpec
from llmfleet.operator.resource.tuner_state import TunerState, pools_to_wake
from llmfleet.operator.tuner.law import Decision
from llmfleet.operator.tuner.run import ROUTER, Autotuner, PoolView, measured_pools, scaling_event, views_from_state
from llmfleet.server.wire.auth import KV_TOKEN_ENV

log = logging.getLogger(__name__)
NAMESPACE = "local"


@dataclass
class FleetView:
    """What the terminal view and the log show."""

    last_decision: Decision | None = None
    last_metrics: dict[str, PoolMetrics] = field(default_factory=dict)
    history: list[str] = field(default_factory=list)  # one line per change or event, newest last
    held: int = 0  # requests the router holds for a pool with no server
    last_cold_start_s: float | None = None  # the last wake: from the router's held request to a ready server


@dataclass
class Wake:
    """A wake under way: when the router was seen holding requests, and the pools woken."""

    at: float
    pools: list[str]


class LocalFleet:
    def __init__(
        self, name: str, spec: InferenceServiceSpec, run_dir: Path, port: int, host: str = "127.0.0.1"
    ) -> None:
        self.name = name
        self.spec = spec
        self.run_dir = run_dir
        self.port = port
        self.host = host
        # The transfer paths are the fleet's own (server/http/auth.py): a token its processes share.
        self.env = {KV_TOKEN_ENV: secrets.token_hex(16)} if spec.mode == "disaggregated" else {}
        self.endpoints_file = run_dir / "endpoints.yaml"
        # the decode servers fetch KV only from the prefill servers this file lists, as the router reads it
        extra = {"decode": ["--endpoints-file", str(self.endpoints_file)]}
        self.pools = {p: LocalPool(p, spec, name, run_dir, self.env, extra.get(p)) for p in spec.active_pools}
        self.tuner_state = TunerState()
        self.autotuner: Autotuner | None = None
        self.router: ServerProcess | None = None
        self.wake: Wake | None = None
        # Prometheus file_sd targets, labelled as the PodMonitor labels pods in the cluster: a
        # Prometheus reading this file serves `--prometheus-url` the same PromQL as in the cluster.
        self.targets_file = run_dir / "prometheus-targets.json"
        self.view = FleetView()
        self._router_failed_starts = 0  # in a row, as for the pools' servers
        self._next_tune = time.monotonic() + spec.autotune.interval_seconds
        self._limited: str | None = None  # the last ScalingLimited reason while True, as status would hold it
        self._hurry = threading.Event()  # a second Ctrl-C: stop without waiting for the drain

    # -- life cycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for pool in self.pools.values():
            pool.write_config(self.tuner_state)
            pool.scale_to(pool.desired_replicas(self.tuner_state))
        self._write_endpoints()
        self._start_router()

    def _start_router(self) -> None:
        args = router_args(self.name, self.spec, self.endpoints_file)
        log_path = self.run_dir / "router.log"
        self.router = ServerProcess(f"{self.name}-router", args, log_path, port=self.port, host=self.host, env=self.env)

    @property
    def served_name(self) -> str:
        """The model name clients send: the spec's model.name, else the InferenceService's."""
        return self.spec.model.name or self.name

    def processes(self) -> list[ServerProcess]:
        found = [p for pool in self.pools.values() for p in pool.all_processes()]
        return found + ([self.router] if self.router else [])

    def serving(self) -> bool:
        """A request sent now is answered: the router is up, and every pool has a ready server (or,
        at zero, is woken by the request)."""
        if self.router is None or not self.router.serving:
            return False
        return all(pool.ready_urls() or pool.replicas == 0 for pool in self.pools.values())

    def stop(self, timeout: float) -> None:
        """Drain every server (each finishes its streams), then kill what is left after ``timeout``
        or once ``hurry()`` is called.

        The router goes first and alone: its streams still need the prefill and decode servers,
        which would refuse them (503) if they drained at the same time. A prefill server's drain
        then waits for decode servers to take the KV it holds; with the router gone, those that
        a failed request left behind have no taker, so once the decode servers are gone the
        prefill servers are told to stop at once (a second SIGTERM)."""
        deadline = time.monotonic() + timeout

        def wait_for(servers: list[ServerProcess]) -> None:
            while any(s.alive for s in servers) and time.monotonic() < deadline and not self._hurry.is_set():
                time.sleep(0.1)

        if self.router is not None:
            self.router.drain()
            wait_for([self.router])
        for server in self.processes():
            server.drain()
        prefill = self.pools["prefill"].all_processes() if "prefill" in self.pools else []
        wait_for([s for s in self.processes() if s not in prefill])
        for server in prefill:
            server.stop_now()
        wait_for(self.processes())
        for server in self.processes():
            server.kill()

    def hurry(self) -> None:
        """Cut a drain under way short: ``stop`` kills what is left."""
        self._hurry.set()

    # -- the control loop -----------------------------------------------------------------------

    def pool_ref(self, pool: str) -> PoolRef:
        return PoolRef(NAMESPACE, self.name, pool)

    def scrape_targets(self, ref: PoolRef) -> list[str]:
        if ref.pool == ROUTER:
            router = self.router
            return [f"{router.url}/metrics"] if router is not None and router.serving else []
        pool = self.pools.get(ref.pool)
        return [f"{url}/metrics" for url in pool.ready_urls()] if pool else []

    def supervise(self) -> None:
        """Reap drained and crashed servers, keep the pools' engine files, the router's endpoints
        and the Prometheus targets current.

        Raises StartFailed when a pool's servers or the router keep exiting before they are ready."""
        for pool in self.pools.values():
            if pool.write_config(self.tuner_state):  # as the operator reverts an edited ConfigMap
                self._note(f"{pool.name}: {pool.config_path.name} was edited: put back (edit the service file)")
            for note in pool.reap():
                self._note(f"{pool.name}: {note}")
        self._write_endpoints()
        self._write_targets()
        self._wake_if_held()
        router = self.router
        if router is not None and not router.ready and router.poll_ready():
            self._router_failed_starts = 0
            self._note(f"router ready at {router.url}")
        elif router is not None and (note := router.probe(time.monotonic())):
            self._note(f"router: {note}")
        if router is not None and not router.alive and not router.draining:
            # As the kubelet restarts a crashed container; one that never got ready stops the fleet.
            if not router.ready:
                self._router_failed_starts += 1
                if self._router_failed_starts >= START_ATTEMPTS:
                    raise StartFailed(f"the router exits before it is ready; it said:\n{router.log_tail(3)}")
            self._note(f"router exited with {router.proc.returncode}: {router.log_tail(3)}; restarting")
            self._start_router()

    def _wake_if_held(self) -> None:
        """The router holds requests while a pool has no server: start the pools at zero now (the
        operator's wake handler, locally), and once every woken pool has a ready server note the
        cold start."""
        router = self.router
        held = 0
        if router is not None and router.serving:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                held = int(httpx.get(f"{router.url}/load", timeout=0.5).json()["held"])
        self.view.held = held
        if held and self.wake is None:
            wake = pools_to_wake(self.spec, self.tuner_state)
            if wake:
                self.wake = Wake(time.monotonic(), sorted(wake))
                for pool, replicas in wake.items():
                    self.apply(pool, replicas, {})
                    self.pools[pool].scale_to(self.pools[pool].replicas)
                woken = ", ".join(f"{pool} 0 -> {n}" for pool, n in wake.items())
                self._note(f"the router holds {held} request{'s' * (held > 1)}: woken, {woken}")
        wake = self.wake
        if wake is not None and all(self.pools[pool].ready_urls() for pool in wake.pools):
            self.wake = None
            self.view.last_cold_start_s = time.monotonic() - wake.at
            self._note(f"cold start: {', '.join(wake.pools)} ready {self.view.last_cold_start_s:.1f} s after the wake")

    def tune_due(self) -> bool:
        return self.spec.autotune.enabled and time.monotonic() >= self._next_tune

    async def tune(self, source: MetricSource) -> Decision:
        """One tuner run (operator/tuner/run.py, as in the cluster): measure, decide, apply."""
        self._next_tune = time.monotonic() + self.spec.autotune.interval_seconds
        if self.autotuner is None:
            refs = {name: self.pool_ref(name) for name in measured_pools(self.spec)}
            self.autotuner = Autotuner(self.spec, source, refs)
        outcome = await self.autotuner.step(_Actuator(self), time.time())
        self.view.last_metrics = outcome.metrics
        self.view.last_decision = outcome.decision
        for _, reason, message in outcome.events:
            if reason != "TunerHolding":
                self._note(message)
        if outcome.scaling is not None:  # the operator's ScalingLimited condition, said once per reason
            limit = scaling_event(outcome.scaling, self._limited)
            if limit is not None:
                self._note(f"{limit[1]}: {limit[2]}")
            self._limited = outcome.scaling.reason if outcome.scaling.status == "True" else None
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
        # The next supervise() starts or drains servers: it runs off the event loop, and picking
        # whom to drain asks each server for its load.
        local.replicas = local.desired_replicas(self.tuner_state)

    def _write_endpoints(self) -> None:
        endpoints = {name: pool.ready_urls() for name, pool in self.pools.items()}
        _replace_if_changed(self.endpoints_file, yaml.safe_dump(endpoints))

    def _write_targets(self) -> None:
        """One target group per ready server, labelled as the PodMonitor labels a pod (``pod``
        too: the dashboards split the engine panels by it), the router as pool ``router``."""
        servers = [(name, s) for name, pool in self.pools.items() for s in pool.servers if s.serving]
        if self.router is not None and self.router.serving:
            servers.append(("router", self.router))
        groups = [
            {
                "targets": [server.url.removeprefix("http://")],
                "labels": {"namespace": NAMESPACE, "inference_service": self.name, "pool": pool, "pod": server.name},
            }
            for pool, server in servers
        ]
        _replace_if_changed(self.targets_file, json.dumps(groups, indent=1))

    def _note(self, line: str) -> None:
        log.info("%s", line)
        self.view.history.append(f"{time.strftime('%H:%M:%S')} {line}")
        del self.view.history[:-50]


def _replace_if_changed(path: Path, text: str) -> None:
    """Readers (the router, Prometheus) see the old file or the new one, never half of one."""
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)


# What the cluster's router flags name that a local router finds otherwise: its own host and
# ports, the pools' Services (the endpoints file instead), the wake ConfigMap (the fleet reads /load).
CLUSTER_ONLY_FLAGS = frozenset(
    {"--host", "--port", "--metrics-port", "--colocated-service", "--prefill-service", "--decode-service"}
    | {"--wake-config-map"}
)


def router_args(name: str, spec: InferenceServiceSpec, endpoints_file: Path) -> list[str]:
    """The router's `llm-fleet serve` arguments as the operator renders them for the cluster, except
    that it finds the servers in ``endpoints_file`` (kept current by the fleet) rather than through
    the pools' headless Services; host and port are the process's own."""
    objects = desired_objects(Owner(name, NAMESPACE, "local"), spec)
    (router,) = (o for o in objects if o["kind"] == "Deployment" and o["metadata"]["labels"][POOL_LABEL] == "router")
    (container,) = router["spec"]["template"]["spec"]["containers"]
    args, rendered = [], container["args"][1:]  # [0] is the `serve` subcommand
    for flag, value in zip(rendered[::2], rendered[1::2], strict=True):
        if flag not in CLUSTER_ONLY_FLAGS:
            args += [flag, value]
    return [*args, "--endpoints-file", str(endpoints_file), "--router-mode", spec.mode]


class _Actuator:
    """The local fleet as the tuner sees it: state in memory, config files and processes."""

    def __init__(self, fleet: LocalFleet) -> None:
        self.fleet = fleet

    def observe(self) -> dict[str, PoolView]:
        return views_from_state(self.fleet.spec, self.fleet.tuner_state)

    def apply(self, pool: str, replicas: int | None, knobs: dict[str, float]) -> None:
        self.fleet.apply(pool, replicas, knobs)
