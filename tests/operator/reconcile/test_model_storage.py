"""Where a pod gets its model: a pvc:// claim mounted read-only, an hf:// model downloaded by the
storage initializer (an init container running `llm-fleet fetch-model`) into a cache volume the
server then reads offline, the Hub token on the download alone. Every manifest passes
kubernetes-validate --strict."""

from __future__ import annotations

import kubernetes_validate
import pytest

from llmfleet.operator.reconcile.desired import Owner, desired_objects
from llmfleet.operator.resource.spec import parse_spec

OWNER = Owner("llama", "ml", "0c0ffee0-0000-4000-8000-000000000002")
SLO = {"ttftP95Ms": 500, "itlP95Ms": 50}


def pod_of(model: dict, **spec) -> dict:
    objects = desired_objects(OWNER, parse_spec({"model": model, "slo": SLO, **spec}))
    # the model server's: the router in front of it loads no model
    (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] != "llama-router"]
    for version in ("1.30", "1.35"):
        kubernetes_validate.validate(deployment, version, strict=True)
    return deployment["spec"]["template"]["spec"]


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_a_claim_is_mounted_read_only_and_its_directory_served():
    pod = pod_of({"uri": "pvc://weights//llama/./3/"})
    (server,) = pod["containers"]
    assert server["args"][server["args"].index("--model") + 1] == "/models/llama/3"
    assert "--download-dir" not in server["args"] and "initContainers" not in pod
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["models"] == {"name": "models", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in server["volumeMounts"]


def test_a_hub_model_is_fetched_by_the_init_container_and_read_offline_by_the_server():
    pod = pod_of(
        {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct@v1.0", "tokenSecret": {"name": "hf"}},
        apiKeySecret={"name": "api"},
        pod={"env": [{"name": "HF_ENDPOINT", "value": "http://mirror:8080"}]},
    )
    (server,) = pod["containers"]
    (init,) = pod["initContainers"]
    assert init["name"] == "fetch-model" and init["image"] == server["image"]
    assert init["command"] == ["llm-fleet"]
    assert init["args"] == ["fetch-model", "hf://Qwen/Qwen2.5-0.5B-Instruct@v1.0", "--download-dir", "/models"]
    assert server["args"][server["args"].index("--model") + 1] == "hf://Qwen/Qwen2.5-0.5B-Instruct@v1.0"
    assert server["args"][server["args"].index("--download-dir") + 1] == "/models"
    # the token reaches the download alone; the server's API key does not reach it
    init_env, server_env = env_of(init), env_of(server)
    assert init_env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert "HF_TOKEN" not in server_env and "VLLM_API_KEY" not in init_env and "VLLM_API_KEY" in server_env
    assert server_env["HF_HUB_OFFLINE"] == "1" and "HF_HUB_OFFLINE" not in init_env
    assert init_env["HF_ENDPOINT"] == server_env["HF_ENDPOINT"] == "http://mirror:8080"  # the pod's settings
    # one cache volume: written by the download, read-only for the server; per pod by default
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["models"] == {"name": "models", "emptyDir": {}}
    assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in server["volumeMounts"]
    assert init["securityContext"] == server["securityContext"]  # non-root, read-only root filesystem


@pytest.mark.parametrize(
    ("cache", "volume"),
    [
        ({"claimName": "hf-cache"}, {"persistentVolumeClaim": {"claimName": "hf-cache"}}),
        ({"sizeLimit": "40Gi"}, {"emptyDir": {"sizeLimit": "40Gi"}}),
    ],
)
def test_the_cache_is_a_shared_claim_or_a_sized_empty_dir(cache, volume):
    pod = pod_of({"uri": "hf://org/model", "cache": cache})
    assert {v["name"]: v for v in pod["volumes"]}["models"] == {"name": "models", **volume}


def test_a_router_downloads_nothing():
    spec = {"mode": "disaggregated", "pools": {"prefill": {}, "decode": {}}}
    objects = desired_objects(OWNER, parse_spec({"model": {"uri": "hf://org/model"}, "slo": SLO, **spec}))
    inits = {
        o["metadata"]["name"]: "initContainers" in o["spec"]["template"]["spec"]
        for o in objects
        if o["kind"] == "Deployment"
    }
    assert inits == {"llama-prefill": True, "llama-decode": True, "llama-router": False}
