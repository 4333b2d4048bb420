"""Helpers for tests that run real `llm-fleet` processes on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from llmfleet.local.processes import free_port

__all__ = ["ServerProcess", "free_port"]


class ServerProcess:
    """`llm-fleet serve` in a subprocess; waits for /ready; stops it on exit."""

    def __init__(
        self,
        *args: str,
        config: Path | None = None,
        log_path: Path | None = None,
        port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "llmfleet.cli", "serve", "--port", str(self.port), *args]
        if config is not None:
            cmd += ["--config", str(config)]
        self.log_path = log_path
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
        environ = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=environ)

    def wait_ready(self, timeout: float = 90.0) -> ServerProcess:
        """This server once /ready answers 200; a server that exits or is not ready in time is
        stopped (never left running past its test) and raises."""
        try:
            return self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s: {self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path or not Path(self.log_path).exists():
            return ""
        return "\n".join(Path(self.log_path).read_text().splitlines()[-lines:])

    def metrics(self) -> dict[str, float]:
        """Flat {sample name with labels: value} from /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("model_name", "engine", "role")
                )
                out[f"{sample.name}{{{labels}}}"] = sample.value
        return out

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def __enter__(self) -> ServerProcess:
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()
