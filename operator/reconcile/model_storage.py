"""Where a model server's pod gets its model: the volume mounted read-only at /models and, for a
Hugging Face model, the storage initializer that fills it, as KServe's storageUri does.

- ``model.path`` with ``model.volume``: that volume, as given.
- ``model.uri: pvc://claim/path``: the claim, read-only; the server loads /models/path.
- ``model.uri: hf://org/name[@revision]``: a cache volume (an emptyDir per pod, or the claim
  ``model.cache.claimName`` that the pool's pods share) which the init container ``fetch-model``
  fills with ``llm-fleet fetch-model`` (the same code as ``llm-fleet serve --model org/name``),
  ``HF_TOKEN`` from ``model.tokenSecret`` on it alone; the server then reads the cache with
  ``HF_HUB_OFFLINE=1``, so it never downloads, and a missing file is an error, not a second fetch.
- a built-in: nothing (the server makes it under /tmp).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmfleet.operator.resource.spec import MODELS_DIR, InferenceServiceSpec
from llmfleet.server.core.model_uri import ClaimModel, HubModel

VOLUME = "models"
INIT_CONTAINER = "fetch-model"


@dataclass
class ModelStorage:
    """What a model server's pod needs for its model, added to what it has."""

    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)  # the server container's
    args: list[str] = field(default_factory=list)  # after the server's --model
    env: list[dict[str, Any]] = field(default_factory=list)  # the server container's
    init_containers: list[dict[str, Any]] = field(default_factory=list)


def model_storage(spec: InferenceServiceSpec, base_env: list[dict[str, Any]], security: dict) -> ModelStorage:
    """The model's volume and mounts, and for an hf:// model the init container that downloads it
    (``base_env`` and ``security``: the server container's env and securityContext, which it shares)."""
    model = spec.model
    source = model.source
    read_only = {"name": VOLUME, "mountPath": MODELS_DIR, "readOnly": True}
    if isinstance(source, ClaimModel):
        claim = {"claimName": source.claim, "readOnly": True}
        return ModelStorage(volumes=[{"name": VOLUME, "persistentVolumeClaim": claim}], mounts=[read_only])
    if isinstance(source, HubModel):
        return _hub_storage(spec, source, base_env, security)
    if model.volume:
        source_fields = {key: value for key, value in model.volume.items() if key != "name"}  # the mount names it
        return ModelStorage(volumes=[{"name": VOLUME, **source_fields}], mounts=[read_only])
    return ModelStorage()


def _hub_storage(
    spec: InferenceServiceSpec, source: HubModel, base_env: list[dict[str, Any]], security: dict
) -> ModelStorage:
    cache = spec.model.cache
    if cache is not None and cache.claim_name:
        volume: dict[str, Any] = {"name": VOLUME, "persistentVolumeClaim": {"claimName": cache.claim_name}}
    else:
        volume = {"name": VOLUME, "emptyDir": {"sizeLimit": cache.size_limit} if cache and cache.size_limit else {}}
    token = spec.model.token_secret
    token_env = (
        [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}}] if token else []
    )
    init = {
        "name": INIT_CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["llm-fleet"],
        "args": ["fetch-model", str(source), "--download-dir", MODELS_DIR],
        "env": [*_without_secrets(base_env), *token_env],
        "securityContext": security,
        # its one-line error (no such repository, a bad token) becomes the pod's status message
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": VOLUME, "mountPath": MODELS_DIR}],
    }
    return ModelStorage(
        volumes=[volume],
        mounts=[{"name": VOLUME, "mountPath": MODELS_DIR, "readOnly": True}],
        args=["--download-dir", MODELS_DIR],
        env=[{"name": "HF_HUB_OFFLINE", "value": "1"}],
        init_containers=[init],
    )


def _without_secrets(env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The server's env less what only serving needs (its API key, the KV-transfer token): the
    download gets the pod's settings (HF_ENDPOINT for a mirror, a proxy), not the server's keys."""
    return [item for item in env if item["name"] not in ("VLLM_API_KEY", "LLMFLEET_KV_TRANSFER_TOKEN")]
