"""A pool of the local fleet: N server processes of one role sharing one engine config file.

The config file is the local twin of the pool's ConfigMap: the same `engine.yaml`, rendered by the
operator's own `effective_engine`, watched by every server of the pool, so a knob change is a file
write that the servers apply live. Replicas change by starting servers and draining the least
loaded ones (SIGTERM: they finish their streams, then exit), as the operator's scale-down does.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import httpx

from llmfleet.local.processes import START_ATTEMPTS, ServerProcess, StartFailed
from llmfleet.operator.resource.spec import InferenceServiceSpec
from llmfleet.operator.resource.tuner_state import TunerState, effective_engine, effective_replicas

log = logging.getLogger(__name__)


class LocalPool:
    def __init__(
        self,
        name: str,
        spec: InferenceServiceSpec,
        service: str,
        run_dir: Path,
        env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.name = name
        self.env = env or {}  # for every server it starts
        self.extra_args = extra_args or []  # and arguments (the decode servers' prefill servers)
        self.spec = spec
        self.service = service
        self.run_dir = run_dir
        self.config_path = run_dir / f"{name}-engine.yaml"
        self.servers: list[ServerProcess] = []
        self.draining: list[ServerProcess] = []
        self._started = 0
        self._failed_starts = 0  # in a row: servers that exited before their first /ready
        self.replicas = 0  # desired

    @property
    def role(self) -> str:
        return self.name  # colocated | prefill | decode

    def write_config(self, tuner: TunerState) -> bool:
        """Render the pool's engine.yaml; True if its content changed (the servers will reload it)."""
        text = effective_engine(self.spec, self.name, tuner).to_yaml()
        if self.config_path.exists() and self.config_path.read_text() == text:
            return False
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.config_path)  # atomic: a server never reads half a file
        return True

    def desired_replicas(self, tuner: TunerState) -> int:
        return effective_replicas(self.spec, self.name, tuner)

    def server_args(self) -> list[str]:
        return [
            "--role",
            self.role,
            *self.spec.model.server_args,
            "--served-model-name",
            self.spec.model.name or self.service,
            "--config",
            str(self.config_path),
            "--drain-timeout",
            str(self.spec.drain_seconds(self.name)),
            *self.extra_args,
        ]

    def scale_to(self, replicas: int) -> None:
        self.replicas = replicas
        while len(self.servers) < replicas:
            self._started += 1
            name = f"{self.service}-{self.name}-{self._started}"
            self.servers.append(ServerProcess(name, self.server_args(), self.run_dir / f"{name}.log", env=self.env))
            log.info("%s: started %s on port %d", self.name, name, self.servers[-1].port)
        while len(self.servers) > replicas:
            victim = min(self.servers, key=_in_flight)
            self.servers.remove(victim)
            victim.drain()
            self.draining.append(victim)
            log.info("%s: draining %s", self.name, victim.name)

    def reap(self) -> list[str]:
        """Check readiness (probes past start-up), forget drained servers that exited, replace
        crashed ones. Returns what happened."""
        notes = []
        now = time.monotonic()
        for server in self.servers:
            if not server.ready and server.poll_ready():
                self._failed_starts = 0
                notes.append(f"{server.name} ready at {server.url}")
            elif note := server.probe(now):
                notes.append(note)
        for server in [s for s in self.draining if not s.alive]:
            self.draining.remove(server)
            notes.append(f"{server.name} drained")
        for server in [s for s in self.servers if not s.alive]:
            self.servers.remove(server)
            notes.append(f"{server.name} exited with {server.proc.returncode}: {server.log_tail(3)}")
            if not server.ready:
                self._failed_starts += 1
                if self._failed_starts >= START_ATTEMPTS:
                    raise StartFailed(
                        f"{self.name} servers exit before they are ready; the last one said:\n"
                        f"{server.log_tail(5)}\n(full log: {server.log_path})"
                    )
        if len(self.servers) != self.replicas:  # crashed servers replaced, or a new count from the tuner
            self.scale_to(self.replicas)
        return notes

    def ready_urls(self) -> list[str]:
        """Servers that answered /ready (polled by ``reap``, never here: the view calls this often)."""
        return [s.url for s in self.servers if s.serving]

    def all_processes(self) -> list[ServerProcess]:
        return self.servers + self.draining


def _in_flight(server: ServerProcess) -> float:
    """Requests a server holds (running + waiting), from its /load; a server that cannot say goes first."""
    if not server.ready:
        return -1.0
    try:
        load = httpx.get(f"{server.url}/load", timeout=0.5).json()
        return float(load["running"] + load["waiting"])
    except (httpx.HTTPError, ValueError, KeyError):
        return -1.0
