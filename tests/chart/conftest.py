"""Fixtures for the Helm chart tests: the real helm and kubectl binaries, offline renders.

The binaries come from $LLMFLEET_TOOLS_BIN, then <repo>/.tools/bin (scripts/install-tools.sh puts
them there), then PATH. Without them the tests skip, except in CI (CI=true), where they fail.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "llm-fleet"
KUBE_VERSION = "1.33.0"
RELEASE = "fleet"
RELEASE_NAMESPACE = "llm-fleet-system"
INSTALL_HINT = "run `bash scripts/install-tools.sh`"

Render = Callable[..., list[dict[str, Any]]]

# Value variants every rendering test runs over.
WATCHED = ["team-a", "team-b"]
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaces": {"watchNamespaces": WATCHED, "prometheusUrl": "http://prometheus.monitoring:9090"},
    "peering": {"peering": {"enabled": True}, "replicaCount": 2},
    "peering-namespaces": {"peering": {"enabled": True}, "watchNamespaces": WATCHED},
    "dashboards": {"grafana": {"dashboards": {"enabled": True}}},
    "prometheus-rule": {"prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus"}}},
    "pod-monitor-labels": {"podMonitorLabels": {"release": "kube-prometheus-stack"}},
    "metrics-namespaces": {"metricsNamespaceLabels": {"llmfleet.io/scrapes": "true"}},
    "own-account": {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "ops-bot"}},
}


def find_tool(name: str) -> Path | None:
    candidates = []
    if os.environ.get("LLMFLEET_TOOLS_BIN"):
        candidates.append(Path(os.environ["LLMFLEET_TOOLS_BIN"]) / name)
    candidates.append(REPO / ".tools" / "bin" / name)
    on_path = shutil.which(name)
    if on_path:
        candidates.append(Path(on_path))
    return next((c for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def require_tool(name: str) -> Path:
    found = find_tool(name)
    if found is None:
        message = f"{name} not found in $LLMFLEET_TOOLS_BIN, .tools/bin or PATH: {INSTALL_HINT}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


@pytest.fixture(scope="session")
def tool_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Helm's state in a temp dir, and a kubeconfig that points nowhere: nothing here may reach a cluster."""
    home = tmp_path_factory.mktemp("helm-home")
    env = dict(os.environ)
    env.update(
        HELM_CACHE_HOME=str(home / "cache"),
        HELM_CONFIG_HOME=str(home / "config"),
        HELM_DATA_HOME=str(home / "data"),
        KUBECONFIG=str(home / "no-kubeconfig"),
    )
    return env


@pytest.fixture(scope="session")
def helm(tool_env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    binary = require_tool("helm")

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(binary), *args], env=tool_env, capture_output=True, text=True, timeout=60, check=False
        )
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result

    return run


@pytest.fixture(scope="session")
def kubectl(tool_env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    binary = require_tool("kubectl")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(binary), *args], env=tool_env, capture_output=True, text=True, timeout=60, check=False
        )
        if result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result

    return run


# The chart requires the image (a default would name one that may not exist): every render gives one.
IMAGE = {"repository": "registry.example/llm-fleet", "tag": "0.1.0-cuda"}


def with_image(values: dict[str, Any]) -> dict[str, Any]:
    return {**values, "image": {**IMAGE, **(values.get("image") or {})}}


def values_args(values: dict[str, Any], directory: Path, *, image: bool = True) -> list[str]:
    """Values go in as a file (not --set) so lists and nested maps arrive with their real types;
    with the required image unless ``image=False``."""
    values = with_image(values) if image else values
    if not values:
        return []
    digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]
    path = directory / f"values-{digest}.yaml"
    path.write_text(yaml.safe_dump(values))
    return ["-f", str(path)]


@pytest.fixture(scope="session")
def render(helm, tmp_path_factory: pytest.TempPathFactory) -> Render:
    """`helm template` of the chart (or a copy of it) with the given values, parsed; cached per input."""
    workdir = tmp_path_factory.mktemp("values")
    cache: dict[str, list[dict[str, Any]]] = {}

    def run(values: dict[str, Any] | None = None, chart: Path = CHART) -> list[dict[str, Any]]:
        values = values or {}
        key = json.dumps([str(chart), values], sort_keys=True)
        if key not in cache:
            out = helm(
                "template",
                RELEASE,
                str(chart),
                "--namespace",
                RELEASE_NAMESPACE,
                "--kube-version",
                KUBE_VERSION,
                *values_args(values, workdir),
            ).stdout
            cache[key] = [doc for doc in yaml.safe_load_all(out) if doc]
        return cache[key]

    return run


@pytest.fixture(scope="session")
def chart_sync() -> ModuleType:
    """scripts/chart-sync.py: generates the chart's CRD copy and RBAC rules file."""
    spec = importlib.util.spec_from_file_location("chart_sync", REPO / "scripts" / "chart-sync.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rbac_rules_or_skip(chart_sync: ModuleType) -> list[Any]:
    """The operator's RBAC_RULES; skips (with the reason) until operator/deploy/rbac.py exists."""
    if not (REPO / "operator" / "deploy" / "rbac.py").exists():
        pytest.skip(
            "operator/deploy/rbac.py (RBAC_RULES) does not exist yet: nothing to check the chart's RBAC against"
        )
    return chart_sync.load_rbac_rules()


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]
