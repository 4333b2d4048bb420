"""A real Prometheus (the Debian package) on loopback, for tests that need PromQL answered for real.

It scrapes static targets every second; each target group carries the labels the fleet's PodMonitor
adds in a cluster (``namespace``, ``inference_service``, ``pool``), so the operator's PromQL and the
dashboards' queries run unchanged. The first samples land about 5-7 s after start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support import free_port


@dataclass
class TargetGroup:
    targets: Sequence[str]  # "127.0.0.1:PORT"
    labels: Mapping[str, str] = field(default_factory=dict)


def require_prometheus() -> str:
    """The prometheus binary, or skip; in CI (CI=true), which installs it with
    scripts/install-tools.sh, a missing binary fails instead: those tests must run there."""
    path = shutil.which("prometheus")
    if path is None:
        message = "prometheus is not installed (scripts/install-tools.sh installs the Debian package)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


class PrometheusProcess:
    """``with PrometheusProcess([TargetGroup([...], {...})]) as prom: prom.query("up")``."""

    def __init__(
        self,
        groups: Sequence[TargetGroup],
        *,
        scrape_interval: str = "1s",
        rule_files: Sequence[Path] = (),
        log_path: Path | None = None,
        file_sd: Sequence[Path] = (),
    ) -> None:
        self.binary = require_prometheus()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = Path(tempfile.mkdtemp(prefix="llmfleet-prom-"))
        self.log_path = log_path or self._dir / "prometheus.log"
        config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [
                {
                    "job_name": "llm-fleet",
                    "scrape_interval": scrape_interval,
                    "scrape_timeout": scrape_interval,
                    "static_configs": [{"targets": list(g.targets), "labels": dict(g.labels)} for g in groups],
                }
            ],
        }
        if file_sd:  # targets from files (the local fleet's), re-read when they change
            config["scrape_configs"].append(
                {
                    "job_name": "llm-fleet-files",
                    "scrape_interval": scrape_interval,
                    "scrape_timeout": scrape_interval,
                    "file_sd_configs": [{"files": [str(f) for f in file_sd], "refresh_interval": "1s"}],
                }
            )
        self.config_path = self._dir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.proc: subprocess.Popen | None = None

    def start(self) -> PrometheusProcess:
        log = open(self.log_path, "w")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self._dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self._log = log
        try:
            return self._wait_ready()
        except BaseException:
            self.stop()  # never left running past its test (__exit__ does not run when __enter__ raises)
            raise

    def _wait_ready(self) -> PrometheusProcess:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after 30 s: {self.log_tail()}")

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's result vector; raises on a PromQL error."""
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10)
        body = response.json()
        if body.get("status") != "success":
            raise AssertionError(f"{promql!r}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def wait_for(self, promql: str, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Poll until the query returns a non-empty result."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if result:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"no data for {promql!r} after {timeout} s")
            time.sleep(0.5)

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc is not None:
            self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> PrometheusProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
