"""How a router asks for servers when its serving pool has none (scaled to zero): in a cluster it
stamps the wake annotation on its fleet's wake ConfigMap (its Role may get and patch that one
object: not the InferenceService, whose spec says what pods run), which the operator answers at
once; elsewhere nobody needs asking (the local fleet reads the router's held requests from its
``/load``)."""

from __future__ import annotations

import json
import logging
from typing import Protocol

import httpx

from llmfleet.server.wire.wake import WAKE_ANNOTATION, wake_stamp

log = logging.getLogger(__name__)


class Waker(Protocol):
    description: str

    async def wake(self) -> None:
        """Ask for servers; failures are logged, never raised (held requests wait regardless)."""


class NoWaker:
    """Whoever runs the pools watches the router's ``/load`` (``held``) instead."""

    description = "nobody to ask: whoever runs the pools reads the held requests from /load"

    async def wake(self) -> None:
        return None


class ConfigMapWaker:
    """A merge patch of the wake annotation on ``configmaps/<name>``."""

    def __init__(self, api: httpx.AsyncClient, namespace: str, name: str) -> None:
        self.api = api
        self.path = f"/api/v1/namespaces/{namespace}/configmaps/{name}"
        self.description = f"the {WAKE_ANNOTATION} annotation of ConfigMap {namespace}/{name}"

    async def wake(self) -> None:
        patch = {"metadata": {"annotations": {WAKE_ANNOTATION: wake_stamp()}}}
        try:
            response = await self.api.patch(
                self.path, content=json.dumps(patch), headers={"Content-Type": "application/merge-patch+json"}
            )
            response.raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("could not ask for servers through %s: %r", self.description, exc)
