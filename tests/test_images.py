"""The images a cluster pulls: the Dockerfile installs through scripts/install.sh, the script
scripts/setup.sh (and so CI) runs, and the release workflow pushes the CPU and CUDA images under
the names the chart's error, the docs and the examples give. No container engine is needed."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = (REPO / "Dockerfile").read_text()
WORKFLOW = yaml.safe_load((REPO / ".github" / "workflows" / "release.yml").read_text())
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def run_lines() -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    text = DOCKERFILE.replace("\\\n", " ")
    return [line.strip()[4:] for line in text.splitlines() if line.strip().startswith("RUN ")]


def test_the_dockerfile_installs_through_the_script_ci_runs():
    runs = run_lines()
    assert not [r for r in runs if "pip install" in r], "pip installs belong in scripts/install.sh"
    assert "bash scripts/install.sh torch" in runs
    assert "bash scripts/install.sh llm-fleet" in runs
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "bash scripts/install.sh torch" in setup and "bash scripts/install.sh llm-fleet --editable" in setup
    assert (REPO / ".ci" / "run").read_text().count("scripts/test.sh") == 1  # which runs setup.sh
    assert "bash scripts/setup.sh --test" in (REPO / "scripts" / "test.sh").read_text()


def test_the_dockerfile_copies_every_package_directory():
    copied = {line.split()[1] for line in DOCKERFILE.splitlines() if line.startswith("COPY ") and "--from" not in line}
    for directory in set(PYPROJECT["tool"]["setuptools"]["package-dir"].values()):
        assert directory in copied, f"the image would lack {directory}/"
    assert "TORCH_INDEX" in DOCKERFILE and "LLMFLEET_TORCH_INDEX=$TORCH_INDEX" in DOCKERFILE


def test_the_install_script_parses_and_refuses_what_it_does_not_know():
    script = REPO / "scripts" / "install.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    wrong = subprocess.run(["bash", str(script), "everything"], capture_output=True, text=True)
    assert wrong.returncode == 2 and "usage: bash scripts/install.sh" in wrong.stderr
    # torch is already the pinned one here: the step is a no-op that succeeds (as on a rebuilt layer)
    done = subprocess.run(["bash", str(script), "torch"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.timeout(300)
def test_the_non_editable_install_the_image_makes_holds_every_module(tmp_path):
    """The image installs `.` (not editable, as setup.sh does): its wheel must carry the packages
    and their data files."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
        cwd=REPO,
        check=True,
        timeout=240,
    )
    (wheel,) = tmp_path.glob("llm_fleet-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("llmfleet/cli.py", "llmfleet/server/fetch_cli.py", "llmfleet/server/runner/hub.py"):
        assert module in names
    assert any(n.startswith("llmfleet/operator/reconcile/") for n in names)
    assert any(n.startswith("llmfleet/local/") and n.endswith(".yaml") for n in names)


def test_the_release_workflow_pushes_a_cpu_and_a_cuda_image_for_version_tags():
    assert WORKFLOW[True]["push"]["tags"] == ["v*"]  # YAML reads the key `on` as true
    assert WORKFLOW["permissions"]["packages"] == "write"
    job = WORKFLOW["jobs"]["image"]
    variants = {entry["variant"]: entry["torch-index"] for entry in job["strategy"]["matrix"]["include"]}
    assert variants == {
        "cpu": "https://download.pytorch.org/whl/cpu",
        "cuda": "https://download.pytorch.org/whl/cu128",
    }
    steps = {step.get("name", step.get("uses")): step for step in job["steps"]}
    push = steps["Push"]
    assert push["uses"].startswith("docker/build-push-action@") and push["with"]["push"] is True
    assert push["with"]["build-args"] == "TORCH_INDEX=${{ matrix.torch-index }}"
    image = "${{ steps.version.outputs.image }}:${{ steps.version.outputs.version }}-${{ matrix.variant }}"
    assert push["with"]["tags"] == steps["Build"]["with"]["tags"] == image
    version = steps["Version from the tag"]["run"]
    assert 'image=ghcr.io/${GITHUB_REPOSITORY_OWNER,,}/llm-fleet"' in version
    assert "does not match pyproject.toml's version" in version  # a tag never mislabels an image


def test_the_pins_cover_every_requirement_and_fit_its_range():
    """constraints.txt (scripts/lock.sh) is what CI and the images install: each of the package's
    requirements is pinned there, within the range pyproject.toml gives, and torch is left to
    install.sh, whose index chooses the CPU or CUDA build."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    assert "torch" not in pins and "llm-fleet" not in pins
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]
    for text in [*project["dependencies"], *extras["test"], *extras["bench"]]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name == "torch":
            continue
        assert name in pins, f"{name} is not pinned: run scripts/lock.sh"
        assert requirement.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} is not {text}"
    install = (REPO / "scripts" / "install.sh").read_text()
    assert "PINS=(-c constraints.txt)" in install and install.count('"${PINS[@]}"') == 2
    assert "COPY constraints.txt ./" in DOCKERFILE
