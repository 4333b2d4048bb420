"""Who may call what. vLLM's ``--api-key``: with a key set, every ``/v1`` path needs ``Authorization: Bearer <key>``.

As in vLLM, the other paths stay open: probes, scrapers and routers carry no key for ``/health``,
``/ready``, ``/metrics``, ``/load`` and ``/version``. The key comes from ``--api-key`` or the
``VLLM_API_KEY`` environment variable (the operator sets it from a Secret). Our own hops to ``/v1``
paths carry it: the router's requests to the servers, and a decode server's KV fetch from a
prefill server (so one key serves a whole InferenceService).

The transfer paths are the fleet's own, not its clients': with ``LLMFLEET_KV_TRANSFER_TOKEN`` set
(the same random value on the router and every prefill and decode server), ``kv_transfer_params``
and ``/v1/kv`` need it in ``X-LLMFleet-KV-Token``, which only our hops send. Without it, a client
holding the API key could hand a decode server KV of its own making (it enters the prefix cache
other requests read) or have it fetch from any URL.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

API_KEY_ENV = "VLLM_API_KEY"
KV_TOKEN_ENV = "LLMFLEET_KV_TRANSFER_TOKEN"
KV_TOKEN_HEADER = "X-LLMFleet-KV-Token"


def kv_token_from_env() -> str | None:
    # stripped: a Secret made with --from-file ends in a newline, which no header may hold
    return os.environ.get(KV_TOKEN_ENV, "").strip() or None


def fleet_headers(api_key: str | None, kv_token: str | None) -> dict[str, str]:
    """Headers of our own hops to another server: the API key, and the transfer token."""
    return {**bearer(api_key), **({KV_TOKEN_HEADER: kv_token} if kv_token else {})}


def carries_kv_token(headers: Mapping[str, str], kv_token: str | None) -> bool:
    """Whether a request may use the transfer paths: no token set, or the token it carries."""
    return kv_token is None or hmac.compare_digest(headers.get(KV_TOKEN_HEADER, "").encode(), kv_token.encode())


def bearer(api_key: str | None) -> dict[str, str]:
    """Headers for a request to a server that may require ``api_key`` (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
