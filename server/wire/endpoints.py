"""Where the router finds its servers: a static list, a file the local fleet keeps current, or
the EndpointSlices of the pools' Services in Kubernetes; and where a decode server finds the
prefill servers it may fetch KV from: the same, or the addresses of the prefill pool's headless
Service in DNS. Each source answers ``await source.fetch() -> {pool: [url, ...]}`` for the pools
of its mode (``colocated``, or ``prefill`` and ``decode``); the router polls it. Every URL is
written as ``url()`` writes it, so that one source's URL equals another's."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from pathlib import Path
from typing import Protocol
from urllib.parse import quote

import httpx
import yaml

log = logging.getLogger(__name__)

POOLS = ("colocated", "prefill", "decode")
# The pools a router of each mode relays to; the last one is the pool it cannot serve without.
MODE_POOLS = {"colocated": ("colocated",), "disaggregated": ("prefill", "decode")}
Endpoints = dict[str, list[str]]


class EndpointSource(Protocol):
    description: str

    async def fetch(self) -> Endpoints: ...


class StaticEndpoints:
    def __init__(self, prefill: list[str], decode: list[str], colocated: list[str] = ()) -> None:
        self.endpoints = {
            "colocated": [_url(u) for u in colocated],
            "prefill": [_url(u) for u in prefill],
            "decode": [_url(u) for u in decode],
        }
        counts = ", ".join(f"{len(urls)} {pool}" for pool, urls in self.endpoints.items() if urls)
        self.description = f"static: {counts or 'no servers'}"

    async def fetch(self) -> Endpoints:
        return self.endpoints


class EndpointsFile:
    """A YAML mapping ``{pool: [url, ...]}`` (``colocated``, or ``prefill`` and ``decode``), re-read
    when it changes (the local fleet rewrites it atomically as servers become ready or drain)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.description = f"file {self.path}"
        self._stamp: tuple[int, int] | None = None
        self._last: Endpoints = {pool: [] for pool in POOLS}

    async def fetch(self) -> Endpoints:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return {pool: [] for pool in POOLS}
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp:
            try:
                raw = yaml.safe_load(self.path.read_text()) or {}
                self._last = {pool: [_url(u) for u in raw.get(pool) or []] for pool in POOLS}
                self._stamp = stamp
            except (OSError, yaml.YAMLError, AttributeError, TypeError) as exc:
                log.warning("endpoints file %s unreadable, keeping the last good list: %s", self.path, exc)
        return self._last


SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class EndpointSlices:
    """The ready endpoints of the pools' Services, read from the Kubernetes API (EndpointSlices,
    ``discovery.k8s.io/v1``) with the pod's service account: the same list kube-proxy and the
    headless Service's DNS follow, without waiting on DNS caches."""

    def __init__(self, services: dict[str, str], namespace: str, api: httpx.AsyncClient, port_name: str = "http"):
        self.services = services
        self.namespace = namespace
        self.api = api
        self.port_name = port_name
        self.description = f"EndpointSlices of {', '.join(services.values())} in {namespace}"
        self._last: Endpoints = {pool: [] for pool in POOLS}

    @classmethod
    def in_cluster(cls, services: dict[str, str], api_url: str | None = None) -> EndpointSlices:
        """From inside a pod (see ``kube_api``)."""
        client, namespace = kube_api(api_url)
        return cls(services, namespace, client)

    async def fetch(self) -> Endpoints:
        found: Endpoints = {}
        for pool, service in self.services.items():
            selector = quote(f"kubernetes.io/service-name={service}")
            path = f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices?labelSelector={selector}"
            try:
                response = await self.api.get(path)
                response.raise_for_status()
                found[pool] = ready_urls(response.json().get("items") or [], self.port_name)
            except (httpx.HTTPError, ValueError) as exc:  # keep routing on the last good list
                log.warning("cannot list EndpointSlices of %s: %s", service, exc)
                found[pool] = self._last.get(pool, [])
        self._last = found
        return found


def kube_api(api_url: str | None = None) -> tuple[httpx.AsyncClient, str]:
    """A client of the Kubernetes API and the pod's namespace: from inside a pod, the API server,
    token, CA and namespace of its service account; with ``api_url`` (tests, ``kubectl proxy``),
    that URL without credentials and ``$POD_NAMESPACE``."""
    if api_url is not None:
        return httpx.AsyncClient(base_url=api_url, timeout=5.0), os.environ.get("POD_NAMESPACE", "default")
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host or not (SERVICE_ACCOUNT / "token").exists():
        raise SystemExit("--*-service and --wake-config-map need a pod's service account (or --kube-api URL)")
    namespace = (SERVICE_ACCOUNT / "namespace").read_text().strip()
    token = (SERVICE_ACCOUNT / "token").read_text().strip()
    client = httpx.AsyncClient(
        base_url=f"https://{host}:{port}",
        verify=str(SERVICE_ACCOUNT / "ca.crt"),
        headers={"Authorization": f"Bearer {token}"},
        timeout=5.0,
    )
    return client, namespace


def ready_urls(slices: list[dict], port_name: str = "http") -> list[str]:
    """URLs of the ready endpoints of ``slices`` (a missing ``ready`` condition means ready)."""
    urls = []
    for item in slices:
        ports = item.get("ports") or []
        port = next((p.get("port") for p in ports if p.get("name") == port_name), None)
        if port is None and ports:
            port = ports[0].get("port")
        if port is None:
            continue
        for endpoint in item.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            for address in endpoint.get("addresses") or []:
                host = f"[{address}]" if ":" in address else address
                urls.append(f"http://{host}:{port}")
    return sorted(set(urls))


class ServiceDNS:
    """The prefill servers as the addresses ``host`` resolves to, each at ``port``: a headless
    Service's name gives one address per ready pod, as its EndpointSlices list them, with no
    Kubernetes API access (a decode pod has none)."""

    def __init__(self, pool: str, host: str, port: int) -> None:
        self.pool, self.host, self.port = pool, host, port
        self.description = f"DNS {host}:{port}"

    async def fetch(self) -> Endpoints:
        try:
            found = await asyncio.get_running_loop().getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("cannot resolve %s: %s", self.host, exc)
            found = []
        addresses = sorted({info[4][0] for info in found})
        urls = [f"http://[{a}]:{self.port}" if ":" in a else f"http://{a}:{self.port}" for a in addresses]
        return {pool: urls if pool == self.pool else [] for pool in POOLS}


def url(value: str) -> str:
    """A server's URL as every source writes it: a scheme (http:// where none is given), no
    trailing slash."""
    return _url(value)


def _url(value: str) -> str:
    value = str(value).rstrip("/")
    return value if value.startswith(("http://", "https://")) else f"http://{value}"
