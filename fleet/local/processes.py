"""Server processes of the local fleet: `llm-fleet serve` children in their own process groups,
so a Ctrl-C in the terminal reaches the fleet (which drains them) and not the servers directly.
Past start-up the fleet plays the pods' readiness and liveness probes on them, with the
operator's settings: a server that stops answering /ready gets no traffic until it does again,
and one whose /health keeps failing is killed, to be restarted as the kubelet would."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from llmfleet.operator.reconcile.desired import LIVENESS_PROBE, READINESS_PROBE
from llmfleet.server.wire.parent import PARENT_PID_ENV

# A server that exits before it ever answered /ready this many times in a row will not start:
# a bad model path, a role this build lacks. Retrying forever would hide the reason.
START_ATTEMPTS = 3


class StartFailed(RuntimeError):
    """Servers of one pool (or the router) keep exiting before they are ready."""


def reachable_url(host: str, port: int) -> str:
    """How this machine reaches a server bound to ``host``: a wildcard through loopback, an IPv6
    address in brackets."""
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


_HANDED_OUT: dict[int, None] = {}  # ports free_port handed out lately, newest last
_REMEMBERED = 4096


def free_port() -> int:
    """A loopback port free now and not handed out lately by this process. The kernel may offer
    one free port to two binds in a row, and a server binds its port seconds after it was picked:
    two servers started together could both be told one port, and while one failed to bind the
    other would answer its readiness checks and take the requests meant for it."""
    for _ in range(64):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT[port] = None
            if len(_HANDED_OUT) > _REMEMBERED:
                del _HANDED_OUT[next(iter(_HANDED_OUT))]
            return port
    raise OSError("the kernel keeps offering loopback ports this process handed out already")


@dataclass
class Probe:
    """One of a pod's HTTP probes: due every ``period_s``; failing after ``threshold`` misses in a row."""

    path: str
    period_s: float
    timeout_s: float
    threshold: int
    due_at: float = 0.0
    misses: int = 0

    @classmethod
    def like(cls, path: str, settings: dict[str, int], now: float) -> Probe:
        period = float(settings["periodSeconds"])
        return cls(path, period, float(settings.get("timeoutSeconds", 1)), settings["failureThreshold"], now + period)

    def run(self, url: str, now: float) -> bool | None:
        """Probe if due; None when not, else whether it is failing now."""
        if now < self.due_at:
            return None
        self.due_at = now + self.period_s
        try:
            ok = httpx.get(f"{url}{self.path}", timeout=self.timeout_s).status_code == 200
        except httpx.HTTPError:
            ok = False
        self.misses = 0 if ok else self.misses + 1
        return self.misses >= self.threshold


class ServerProcess:
    """One `llm-fleet serve` on loopback; its output goes to ``log_path``."""

    def __init__(
        self,
        name: str,
        args: list[str],
        log_path: Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.port = port or free_port()
        self.url = reachable_url(host, self.port)  # how the fleet reaches it
        self.log_path = log_path
        command = [sys.executable, "-m", "llmfleet.cli", "serve", "--host", host, "--port", str(self.port)]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                command + args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, PARENT_PID_ENV: str(os.getpid()), **(env or {})},
            )
        self.started = time.monotonic()
        self.ready = False  # it answered /ready once: past its start-up
        self.out_of_service = False  # its readiness probe fails since
        self.draining = False
        self._readiness: Probe | None = None
        self._liveness: Probe | None = None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def serving(self) -> bool:
        """It answered /ready, has not failed its readiness probe since, and runs."""
        return self.ready and not self.out_of_service and self.alive

    def poll_ready(self) -> bool:
        """True once /ready answers 200 (checked without waiting)."""
        if not self.ready and self.alive:
            with contextlib.suppress(httpx.HTTPError):
                self.ready = httpx.get(f"{self.url}/ready", timeout=0.5).status_code == 200
        return self.ready

    def probe(self, now: float) -> str | None:
        """Play its readiness and liveness probes where due (past start-up, not draining); what
        changed, if anything. A failed liveness probe kills it: whoever supervises restarts it."""
        if not self.ready or self.draining or not self.alive:
            return None
        if self._readiness is None or self._liveness is None:
            self._readiness = Probe.like("/ready", READINESS_PROBE, now)
            self._liveness = Probe.like("/health", LIVENESS_PROBE, now)
        live = self._liveness
        if live.run(self.url, now):
            self.kill()
            return f"{self.name} failed {live.misses} liveness probes ({live.path}) in a row: killed"
        failing = self._readiness.run(self.url, now)
        if failing is None or failing == self.out_of_service:
            return None
        self.out_of_service = failing
        if failing:
            return f"{self.name} failed its readiness probe ({self._readiness.path}): no traffic until it passes"
        return f"{self.name} passes its readiness probe again"

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.poll_ready():
            if not self.alive:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s; see {self.log_path}")
            time.sleep(0.2)

    def drain(self) -> None:
        """SIGTERM: the server refuses new requests, finishes its streams, then exits."""
        self.draining = True
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)

    def stop_now(self) -> None:
        """A second SIGTERM: a draining server stops without waiting for its drain to end."""
        self.drain()

    def kill(self) -> None:
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
