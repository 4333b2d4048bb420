"""The KV-transfer token of a disaggregated fleet whose spec names no Secret for it.

The router, prefill and decode servers of a disaggregated fleet share a token that KV transfers
must carry (server/http/auth.py); without one, any client that reaches a pod could hand a decode
server KV of its own making. Where ``spec.kvTransferSecret`` is unset, the operator makes the
Secret ``<name>-kv-transfer`` once, with a random token, and the pods read it as they would the
spec's. It is never rewritten: the running pods read theirs at start. Controlled by the
InferenceService, it goes with it (garbage collection); it stays while the fleet runs colocated,
for a switch back.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from llmfleet.operator.reconcile.cluster import ApiError, KubeClient
from llmfleet.operator.reconcile.desired import Owner, generated_kv_secret, owner_labels
from llmfleet.operator.resource.spec import InferenceServiceSpec, KVTransferSecret

TOKEN_BYTES = 32


async def ensure_kv_secret(client: KubeClient, owner: Owner, spec: InferenceServiceSpec) -> str | None:
    """Create the generated Secret if the fleet needs one and it is missing: "Secret/<name>" when
    created, None otherwise.

    The operator may create Secrets but read none, so it does not look first: a 409 says the
    Secret is there, made on an earlier pass (or by someone who may create Secrets in the
    namespace, and so may read them too). One deleted by hand is made again with a new token:
    servers still holding the old one fall back to computing prompts themselves until they
    restart (docs/disaggregation.md, on the KV-transfer token)."""
    wanted = generated_kv_secret(owner, spec)
    if wanted is None:
        return None
    try:
        await client.create(_secret(owner, wanted))
    except ApiError as err:
        if err.status != 409:
            raise
        return None
    return f"Secret/{wanted.name}"


def _secret(owner: Owner, wanted: KVTransferSecret) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": wanted.name,
            "namespace": owner.namespace,
            "labels": owner_labels(owner),
            "ownerReferences": [owner.reference()],
        },
        "type": "Opaque",
        "data": {wanted.key: _token()},
    }


def _token() -> str:
    """A random hex token, base64-encoded as Secret data is (hex: it travels in an HTTP header)."""
    return base64.b64encode(secrets.token_hex(TOKEN_BYTES).encode()).decode()
