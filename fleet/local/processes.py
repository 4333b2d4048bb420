"""Server processes of the local fleet: `llm-fleet serve` children in their own process groups,
so a Ctrl-C in the terminal reaches the fleet (which drains them) and not the servers directly."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

# A server that exits before it ever answered /ready this many times in a row will not start:
# a bad model path, a role this build lacks. Retrying forever would hide the reason.
START_ATTEMPTS = 3


class StartFailed(RuntimeError):
    """Servers of one pool (or the router) keep exiting before they are ready."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        self.url = f"http://127.0.0.1:{self.port}"  # how the fleet reaches it, whatever it binds
        self.log_path = log_path
        command = [sys.executable, "-m", "llmfleet.cli", "serve", "--host", host, "--port", str(self.port)]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                command + args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        self.started = time.monotonic()
        self.ready = False
        self.draining = False

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def serving(self) -> bool:
        """It answered /ready and has not exited since."""
        return self.ready and self.alive

    def poll_ready(self) -> bool:
        """True once /ready answers 200 (checked without waiting)."""
        if not self.ready and self.alive:
            with contextlib.suppress(httpx.HTTPError):
                self.ready = httpx.get(f"{self.url}/ready", timeout=0.5).status_code == 200
        return self.ready

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

    def kill(self) -> None:
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
