"""`helm lint --strict` over the value variants, values.schema.json rejecting bad values, and the
install script's syntax."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.chart.conftest import CHART, KUBE_VERSION, REPO, VARIANTS, values_args


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_helm_lint_strict(helm, tmp_path: Path, variant: str) -> None:
    values = values_args(VARIANTS[variant], tmp_path)
    result = helm("lint", "--strict", "--kube-version", KUBE_VERSION, str(CHART), *values)
    assert "0 chart(s) failed" in result.stdout, result.stdout
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"unknownKey": 1}, "additional properties 'unknownKey'"),
        ({"watchNamespaces": ["team-*"]}, "does not match pattern"),  # Roles need exact names, not globs
        ({"prometheusUrl": "prometheus:9090"}, "does not match pattern"),
        ({"replicaCount": 0}, "minimum"),
        ({"image": {"repository": "x", "pullPolicy": "Sometimes"}}, "pullPolicy"),
        ({"liveness": {"port": 80}}, "minimum"),  # non-root cannot bind below 1024
        ({"replicaCount": 2}, "needs peering.enabled=true"),  # standalone operators do not coordinate
        ({"test": {"image": {"repository": "curlimages/curl", "tag": ""}}}, "test.image.tag must name a tag"),
        # bound to the namespace's "default" account, every pod running as it would get the operator's rights
        ({"serviceAccount": {"create": False}}, "serviceAccount.create=false needs serviceAccount.name"),
    ],
)
def test_bad_values_are_rejected(helm, tmp_path: Path, values: dict, message: str) -> None:
    result = helm("template", "fleet", str(CHART), *values_args(values, tmp_path), check=False)
    assert result.returncode != 0, f"{values} rendered:\n{result.stdout[:400]}"
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize("image", [{}, {"repository": "ghcr.io/me/llm-fleet"}, {"tag": "0.1.0-cuda"}])
def test_the_image_is_required_with_a_clear_message(helm, tmp_path: Path, image: dict) -> None:
    """No default image: one nobody published would leave every pod in ImagePullBackOff."""
    values = values_args({"image": image} if image else {}, tmp_path, image=False)
    result = helm("template", "fleet", str(CHART), *values, check=False)
    assert result.returncode != 0
    assert "image.repository and image.tag are required: the llm-fleet image your cluster can pull" in result.stderr
    assert "docs/cluster-quickstart.md" in result.stderr


def test_install_tools_script_parses() -> None:
    subprocess.run(["bash", "-n", str(REPO / "scripts" / "install-tools.sh")], check=True)
