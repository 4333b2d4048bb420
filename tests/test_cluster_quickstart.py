"""docs/cluster-quickstart.md walked step by step as far as one machine allows: no cluster, no
container engine. The steps come from the page itself (tests/quickstart_steps.py).

2. `helm install` is rendered with the page's own flags (`helm template`): the operator runs the
   image the page exports and hands it to the server pods.
3. The example passes the CRD's schema and rules and becomes the operator's Deployment.
   The test then plays the kubelet: it runs the Deployment's init container command (the storage
   initializer, `llm-fleet fetch-model`) against a fake Hub on loopback that serves a small model
   under the example's repository name, then the server container's command on the filled cache,
   with the container's environment (offline: the server never reaches the Hub).
4. The page's Python client runs against that server.
5. The clean-up names what steps 2 and 3 created.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib

import httpx
import pytest
import yaml

from llmfleet.operator.reconcile.desired import Owner, desired_objects
from llmfleet.operator.resource.spec import parse_spec, require_image
from tests.chart.conftest import CHART, REPO, require_tool
from tests.fakehub import FakeHub, hub_env, model_files
from tests.operator.resource import crdcheck
from tests.quickstart_steps import CLEAN_UP, steps
from tests.support import ServerProcess, free_port

IMAGE = {"IMAGE_REPOSITORY": "registry.example/llm-fleet", "IMAGE_TAG": "0.1.0-cpu"}
STEPS = steps()


def expand(command: str) -> list[str]:
    """A command line as bash would split it, with the image variables the page exports."""
    return shlex.split(os.path.expandvars(command))


@pytest.fixture
def image_env(monkeypatch):
    for name, value in IMAGE.items():
        monkeypatch.setenv(name, value)
    return f"{IMAGE['IMAGE_REPOSITORY']}:{IMAGE['IMAGE_TAG']}"


def test_the_page_has_its_steps_in_order():
    assert list(STEPS) == [
        "1. The image: a release",
        "1. The image: your own build",
        "2. The operator",
        "3. A model",
        "4. A request: the port",
        "4. A request: the client",
        "5. Clean up",
    ]
    # step 1 names what the release workflow publishes for the current version
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert STEPS["1. The image: a release"].commands == [
        f"export IMAGE_REPOSITORY=ghcr.io/<owner>/llm-fleet IMAGE_TAG={version}-cuda"
    ]
    build = STEPS["1. The image: your own build"].commands
    assert "--build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 ." in build[1]


def test_step_2_installs_the_operator_with_the_exported_image(image_env, tmp_path):
    apply_crds, install = STEPS["2. The operator"].commands
    assert expand(apply_crds) == ["kubectl", "apply", "--server-side", "-f", "crds/"]
    assert (REPO / "crds" / "inferenceservice.yaml").is_file()
    words = expand(install)
    assert words[:4] == ["helm", "install", "llm-fleet", "charts/llm-fleet"]
    # helm template takes install's flags but --wait and --create-namespace (which need a cluster)
    flags = [w for w in words[4:] if w not in ("--wait", "--create-namespace")]
    helm = require_tool("helm")
    env = {**os.environ, "HELM_CACHE_HOME": str(tmp_path / "c"), "HELM_CONFIG_HOME": str(tmp_path / "g")}
    env["KUBECONFIG"] = str(tmp_path / "no-kubeconfig")
    out = subprocess.run(
        [str(helm), "template", "llm-fleet", str(CHART), *flags], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    (deployment,) = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment"]
    assert deployment["metadata"]["namespace"] == "llm-fleet-system"
    (operator,) = deployment["spec"]["template"]["spec"]["containers"]
    assert operator["image"] == image_env
    env_vars = {e["name"]: e.get("value") for e in operator["env"]}
    assert env_vars["LLMFLEET_SERVER_IMAGE"] == image_env  # the servers' default image


@pytest.mark.timeout(600)
def test_steps_3_and_4_serve_the_example_from_a_fake_hub(image_env, monkeypatch, tmp_path):
    apply_example, wait, get = STEPS["3. A model"].commands
    words = expand(apply_example)
    assert words[:3] == ["kubectl", "apply", "-f"]
    resource = yaml.safe_load((REPO / words[3]).read_text())
    name = resource["metadata"]["name"]
    assert wait == f"kubectl wait llmis/{name} --for=condition=Ready --timeout=15m"
    assert get == f"kubectl get llmis {name}"
    crd = yaml.safe_load((REPO / "crds" / "inferenceservice.yaml").read_text())
    assert crdcheck.validate(resource, crd) == []  # what the API server checks

    # the operator, with the default image the chart gave it (step 2)
    monkeypatch.setenv("LLMFLEET_SERVER_IMAGE", image_env)
    spec = parse_spec(resource["spec"])
    require_image(spec)
    objects = desired_objects(Owner(name, "default", "0c0ffee0-0000-4000-8000-00000000000a"), spec)
    # the model server's, not the router's in front of it; its engine config, not the wake ConfigMap
    (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] != f"{name}-router"]
    (config,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-engine")]
    (service,) = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == name]
    pod = deployment["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (server,) = pod["containers"]
    assert init["image"] == server["image"] == image_env

    models = tmp_path / "models"  # the pod's cache volume, at /models in both containers
    engine_yaml = tmp_path / "engine.yaml"  # the ConfigMap, mounted at /etc/llm-fleet
    engine_yaml.write_text(config["data"]["engine.yaml"])
    with FakeHub() as hub:
        environ = hub_env(monkeypatch, hub)
        from llmfleet.server.runner.builtin_models import resolve_model

        repo_id = spec.model.source.repo_id
        hub.repo(repo_id).add(model_files(resolve_model("builtin:tiny")), "main")  # a small model by that name

        # the kubelet: the init container first (its env as the pod gives it, HF_ENDPOINT to the fake Hub)
        assert init["command"] == ["llm-fleet"]
        fetched = subprocess.run(
            [sys.executable, "-m", "llmfleet.cli", *pod_args(init["args"], models)],
            env={**os.environ, **container_env(init, tmp_path), **environ},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert fetched.returncode == 0, fetched.stderr
        assert hub.requests("GET", "/resolve/")

        # then the server container, on the filled cache, offline as its env says
        hub.seen.clear()
        port = free_port()
        args = pod_args(server["args"], models, host="127.0.0.1", port=port, config=engine_yaml)
        assert args[0] == "serve"
        server_env = {**container_env(server, tmp_path), "HF_ENDPOINT": hub.url}
        assert server_env["HF_HUB_OFFLINE"] == "1"
        process = ServerProcess(*args[1:], port=port, env=server_env, log_path=tmp_path / "server.log")
        try:
            process.wait_ready(timeout=300)
            assert hub.seen == []  # the server read the cache alone

            # step 4: the port-forward reaches the client Service; the page's client runs against it
            (forward,) = STEPS["4. A request: the port"].commands
            assert forward == f"kubectl port-forward svc/{name} 8000:8000 &"
            assert service["spec"]["ports"][0]["port"] == 8000
            client = STEPS["4. A request: the client"].code.replace("http://127.0.0.1:8000", process.url)
            answered = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, timeout=120)
            assert answered.returncode == 0, answered.stderr
            served = httpx.get(f"{process.url}/v1/models", timeout=5).json()["data"]
            assert [m["id"] for m in served] == [resource["spec"]["model"]["name"]]
        finally:
            process.stop()


def test_step_5_removes_what_steps_2_and_3_made():
    delete, uninstall = STEPS[CLEAN_UP].commands
    assert delete == "kubectl delete -f examples/quickstart.yaml --wait=true"
    install = expand(STEPS["2. The operator"].commands[1])
    assert expand(uninstall) == ["helm", "uninstall", install[2], "-n", install[install.index("-n") + 1]]


def pod_args(args: list[str], models, *, host=None, port=None, config=None) -> list[str]:
    """A container's args on this machine: the cache volume's mount path, the config file, the
    address mapped onto what the test made."""
    out = [str(models) if a == "/models" else a for a in args]
    for flag, value in (("--host", host), ("--port", port), ("--config", config)):
        if value is not None:
            out[out.index(flag) + 1] = str(value)
    return out


def container_env(container: dict, tmp_path) -> dict[str, str]:
    """A container's plain env values (the downward API and Secrets have none here), /tmp its own."""
    values = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    return {**values, "HOME": str(scratch), "LLMFLEET_CACHE": os.environ["LLMFLEET_CACHE"]}


def test_the_published_names_are_the_ones_users_are_told():
    """ghcr.io/<owner>/llm-fleet:<version>-cuda|-cpu: in the chart's error, the values file, the docs."""
    name = re.compile(r"ghcr\.io/<owner>/llm-fleet")
    helpers = (REPO / "charts" / "llm-fleet" / "templates" / "_helpers.tpl").read_text()
    values = (REPO / "charts" / "llm-fleet" / "values.yaml").read_text()
    quickstart = (REPO / "docs" / "cluster-quickstart.md").read_text()
    dockerfile = (REPO / "Dockerfile").read_text()
    for text in (helpers, values, quickstart, dockerfile):
        assert name.search(text), text[:200]
    assert "<version>-cuda" in helpers and "<version>-cuda" in values


def test_the_readme_gives_the_pages_commands():
    """The README's short cluster quick start is the page's, command for command."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## On a Kubernetes cluster") : readme.index("## Documentation")]
    block = section[section.index("```bash") : section.index("```", section.index("```bash") + 3)]
    given = [line for line in block.splitlines()[1:] if line.startswith(("export", "docker", "kubectl", "helm"))]
    page = [command for step in STEPS.values() if step.lang == "bash" for command in step.commands]
    assert len(given) >= 6
    for command in given:
        assert command in page, f"README: {command!r} is not on docs/cluster-quickstart.md"
