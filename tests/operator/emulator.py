"""kmock's KubernetesEmulator with the gaps DESIGN §5 lists closed, enough for the real kopf and
the operator's own client to behave as against a real API server:

- objects get uid, resourceVersion, creationTimestamp and generation (bumped on spec changes);
  a write that changes nothing changes no resourceVersion and sends no watch event;
- lists carry the current resourceVersion and filter by labelSelector; watches replay from the
  resourceVersion they are given (or the current objects without one);
- discovery: the bundled built-in resources plus the InferenceService CRD with its status
  subresource (and optionally the Prometheus operator's PodMonitor and the LeaderWorkerSet CRD);
- PATCH speaks JSON patch (a failed test is 422), merge patch, strategic merge (as merge) and
  server-side apply; the status subresource only touches status, the main resource never does;
- PUT replaces (409 on a stale resourceVersion); DELETE honours finalizers, and the garbage
  collector removes dependents whose owner is gone (background propagation);
- injected faults (Fault) answer reads, watches and writes as the API server's errors do, with a
  Retry-After header when asked (kmock's KubernetesError carries none), or a watch with the
  410 Gone ERROR event of an expired resourceVersion; a Stall holds a request until the test
  lets it go, then fails it (a process that dies mid-request never sees the answer);
- kopf's peering resources (kopf.dev) on request, for several operator replicas.

Server-side apply is modelled for a single field manager: fields the manager applied before and
no longer applies are removed; everything else merges. That is exactly SSA's outcome when the
operator is the only writer of its objects' spec, as in these tests.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import random
import string
import threading
import uuid
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import yaml
from kmock import KubernetesEmulator, KubernetesError, ResourceInfo, Server, resource

WRITE_METHODS = {"POST", "PUT", "PATCH", "DELETE"}
# kmock finds a request's reaction by scanning its whole request log for that request, so each
# request cost time in proportion to all before it (a long operator test spent most of its time
# there); it keeps this many, and the full log is ours (Cluster.log)
KMOCK_LOG_KEPT = 64


def _conflict(message: str) -> KubernetesError:
    return KubernetesError(status=409, reason="Conflict", message=message)


def _not_found(what: str) -> KubernetesError:
    return KubernetesError(status=404, reason="NotFound", message=f"{what} not found")


@attrs.frozen
class _InjectedError(KubernetesError):
    """A Fault's answer: kmock's KubernetesError carries no headers, this one a Retry-After."""

    retry_after: int | None = None


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def removals(before: Any, after: Any) -> Any:
    """A merge patch nulling what `before` set and `after` no longer does (maps only)."""
    if not isinstance(before, dict) or not isinstance(after, dict):
        return None
    out: dict[str, Any] = {}
    for key, value in before.items():
        if key not in after:
            out[key] = None
        elif isinstance(value, dict) and isinstance(after[key], dict):
            nested = removals(value, after[key])
            if nested:
                out[key] = nested
    return out


def _match_labels(obj: dict[str, Any], selector: str | None) -> bool:
    if not selector:
        return True
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in selector.split(","):
        term = term.strip()
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key.rstrip("=")) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


@dataclass
class Change:
    rv: int
    resource: str  # "group/version/plural"
    namespace: str | None
    type: str  # ADDED | MODIFIED | DELETED
    object: dict[str, Any]


@dataclass
class Fault:
    """Answer matching requests with an error (a flaky or failing API server), with a Retry-After
    header when `retry_after` is set (as the API server throttles: 429 and seconds). ``watch``
    (GETs only): True matches watch requests alone, False lists and gets alone, None both; a
    watch fault with status 410 opens the stream and ends it with the ERROR event of an expired
    resourceVersion, as the API server does. ``agent``: only requests whose User-Agent starts so
    (``kopf/`` for kopf's connection, ``llm-fleet-operator`` for the operator's own client)."""

    method: str
    path_part: str
    status: int = 500
    times: int = 1_000_000
    retry_after: int | None = None
    watch: bool | None = None
    agent: str | None = None
    hits: int = 0

    def matches(self, method: str, path: str, watching: bool = False, agent: str = "") -> bool:
        return (
            self.times > 0
            and method == self.method
            and self.path_part in path
            and (self.watch is None or self.watch == watching)
            and (self.agent is None or agent.startswith(self.agent))
        )


@dataclass
class Stall:
    """Hold the first ``times`` matching requests until ``release()`` (from any thread), then answer
    them 503: a request in flight when its sender dies, which the sender never sees answered."""

    method: str
    path_part: str
    times: int = 1
    held: int = 0
    _release: threading.Event = field(default_factory=threading.Event)

    def matches(self, method: str, path: str) -> bool:
        return self.times > 0 and method == self.method and self.path_part in path

    def release(self) -> None:
        self._release.set()

    async def hold(self) -> None:
        self.times -= 1
        self.held += 1
        while not self._release.is_set():
            await asyncio.sleep(0.05)


@attrs.define(kw_only=True)
class Cluster(KubernetesEmulator):
    """The emulated API server. Use `objects(...)` and `writes()` for assertions."""

    store: dict[tuple[str, str | None, str], dict[str, Any]] = attrs.field(factory=dict, init=False)
    changes: list[Change] = attrs.field(factory=list, init=False)
    applied: dict[tuple[str, str | None, str, str], dict[str, Any]] = attrs.field(factory=dict, init=False)
    revision: int = attrs.field(default=1, init=False)
    faults: list[Fault] = attrs.field(factory=list, init=False)
    stalls: list[Stall] = attrs.field(factory=list, init=False)
    _changed: asyncio.Condition | None = attrs.field(default=None, init=False)
    log: list[Any] = attrs.field(factory=list, init=False)  # every request, for writes() and calls()

    def declare(self, key: str, info: ResourceInfo) -> None:
        self.resources[key] = info

    # -- helpers ---------------------------------------------------------------------------------

    @staticmethod
    def key_of(res: resource) -> str:
        return f"{res.group}/{res.version}/{res.plural}"

    def _info(self, res: resource) -> ResourceInfo:
        for known in self.resources:
            if known == res:
                return self.resources[known]
        raise KubernetesError(status=404, reason="NotFound", message=f"the server could not find {res}")

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def _record(self, res_key: str, namespace: str | None, type_: str, obj: dict[str, Any]) -> None:
        self.changes.append(Change(self.revision, res_key, namespace, type_, copy.deepcopy(obj)))

    async def _notify(self) -> None:
        condition = self._condition()
        async with condition:
            condition.notify_all()

    def _bump(self, obj: dict[str, Any]) -> None:
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)

    def _commit(self, res_key: str, namespace: str | None, name: str, old: dict | None, new: dict) -> bool:
        """Store `new` if it differs from `old`; bump versions; record the change. True if written."""
        if old is not None and new == old:
            return False
        if old is not None:
            spec_of = {k: v for k, v in new.items() if k not in ("metadata", "status")}
            spec_was = {k: v for k, v in old.items() if k not in ("metadata", "status")}
            if spec_of != spec_was:
                new["metadata"]["generation"] = int(old["metadata"].get("generation") or 1) + 1
        self._bump(new)
        self.store[(res_key, namespace, name)] = new
        meta = new["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._remove(res_key, namespace, name)
        else:
            self._record(res_key, namespace, "ADDED" if old is None else "MODIFIED", new)
        return True

    def _remove(self, res_key: str, namespace: str | None, name: str) -> None:
        obj = self.store.pop((res_key, namespace, name))
        self._bump(obj)
        self._record(res_key, namespace, "DELETED", obj)
        for key in [k for k in self.applied if k[:3] == (res_key, namespace, name)]:
            del self.applied[key]
        self._collect_garbage(obj["metadata"]["uid"])

    def _collect_garbage(self, owner_uid: str) -> None:
        """Background cascading deletion: dependents of a deleted owner go too."""
        for (res_key, namespace, name), obj in list(self.store.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if any(ref.get("uid") == owner_uid for ref in refs) and (res_key, namespace, name) in self.store:
                self._delete(res_key, namespace, name)

    def _delete(self, res_key: str, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self.store[(res_key, namespace, name)]
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                new = copy.deepcopy(obj)
                new["metadata"]["deletionTimestamp"] = _now()
                self._commit(res_key, namespace, name, obj, new)
            return self.store.get((res_key, namespace, name), obj)
        self._remove(res_key, namespace, name)
        return obj

    def _new_object(self, res: resource, namespace: str | None, body: dict[str, Any]) -> dict[str, Any]:
        info = self._info(res)
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(random.choices(string.ascii_lowercase, k=5))
        if not meta.get("name"):
            raise KubernetesError(status=422, reason="Invalid", message="metadata.name is required")
        if info.namespaced:
            meta["namespace"] = namespace or meta.get("namespace") or "default"
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        meta.pop("deletionTimestamp", None)
        obj.setdefault("apiVersion", f"{res.group}/{res.version}" if res.group else res.version)
        obj.setdefault("kind", info.kind)
        if "status" in info.subresources:
            obj.pop("status", None)
        return obj

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        response = await super()._render_error(exc)
        if isinstance(exc, _InjectedError) and exc.retry_after is not None:
            response.headers["Retry-After"] = str(exc.retry_after)
        return response

    # -- reads -----------------------------------------------------------------------------------

    def _matching(self, res_key: str, namespace: str | None, selector: str | None) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(obj)
            for (key, ns, _), obj in sorted(self.store.items(), key=lambda kv: (kv[0][1] or "", kv[0][2]))
            if key == res_key and (namespace is None or ns == namespace) and _match_labels(obj, selector)
        ]

    async def _serve_list(self, request: Any) -> Any:
        info = self._info(request.resource)
        items = self._matching(self.key_of(request.resource), request.namespace, request.params.get("labelSelector"))
        return {
            "apiVersion": f"{request.resource.group}/{request.resource.version}".lstrip("/"),
            "kind": f"{info.kind}List",
            "metadata": {"resourceVersion": str(self.revision)},
            "items": items,
        }

    async def _serve_fetch(self, request: Any) -> Any:
        self._info(request.resource)
        obj = self.store.get((self.key_of(request.resource), request.namespace, request.name))
        if obj is None:
            raise _not_found(f"{request.resource.plural} {request.name!r}")
        return copy.deepcopy(obj)

    async def _serve_watch(self, request: Any) -> AsyncIterator[Any]:
        yield b""  # send the headers now, even if nothing happens for a while
        res_key = self.key_of(request.resource)
        selector = request.params.get("labelSelector")
        since = request.params.get("resourceVersion")
        if since and since != "0":
            cursor = next((i for i, c in enumerate(self.changes) if c.rv > int(since)), len(self.changes))
        else:
            cursor = len(self.changes)
            for obj in self._matching(res_key, request.namespace, selector):
                yield {"type": "ADDED", "object": obj}
        condition = self._condition()
        while True:
            while cursor < len(self.changes):
                change = self.changes[cursor]
                cursor += 1
                if change.resource != res_key or (request.namespace and change.namespace != request.namespace):
                    continue
                if _match_labels(change.object, selector):
                    yield {"type": change.type, "object": change.object}
            seen = cursor
            async with condition:
                await condition.wait_for(lambda seen=seen: seen < len(self.changes))

    # -- writes ----------------------------------------------------------------------------------

    def _fault(self, request: Any) -> Fault | None:
        """The first injected fault matching this request, counted as used."""
        method, watching = _method(request), request.params.get("watch") in ("true", "1")
        agent = request.headers.get("User-Agent", "")
        for fault in self.faults:
            if fault.matches(method, request.url.path, watching, agent):
                fault.times -= 1
                fault.hits += 1
                return fault
        return None

    async def _handle(self, request: Any) -> aiohttp.web.StreamResponse:
        self.log.append(request)
        del self._requests[:-KMOCK_LOG_KEPT]  # this request, the last, is kept for its dispatch
        res = request.resource
        method = _method(request)
        if res is None or res.plural is None:
            return await super()._handle(request)  # discovery
        for stall in self.stalls:
            if stall.matches(method, request.url.path):
                await stall.hold()
                raise _InjectedError(status=503, reason="InjectedFault", message="held, then failed by the test")
        fault = self._fault(request)
        if fault is not None and fault.status == 410 and request.params.get("watch") in ("true", "1"):
            return await self._expired_watch(request)  # an ERROR event ends the stream
        if fault is not None:
            message = "injected by the test"
            raise _InjectedError(fault.status, "InjectedFault", message, retry_after=fault.retry_after)
        if method not in WRITE_METHODS:
            return await super()._handle(request)  # reads: kmock's routing + our _serve_*
        # Skip KubernetesEmulator's own bookkeeping: every write is handled here.
        try:
            status, body = self._write(method, request)
        finally:
            await self._notify()
        return aiohttp.web.json_response(body, status=status)

    async def _expired_watch(self, request: Any) -> aiohttp.web.StreamResponse:
        response = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)
        gone = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired", "code": 410}
        event = {"type": "ERROR", "object": {**gone, "message": "too old resource version"}}
        await response.write(json.dumps(event).encode() + b"\n")
        await response.write_eof()
        return response

    def _write(self, method: str, request: Any) -> tuple[int, dict[str, Any]]:
        res, namespace, name, sub = request.resource, request.namespace, request.name, request.subresource
        res_key = self.key_of(res)
        info = self._info(res)
        data = request.data
        if method == "POST" and name is None:
            obj = self._new_object(res, namespace, data or {})
            key = (res_key, obj["metadata"].get("namespace"), obj["metadata"]["name"])
            if key in self.store:
                raise _conflict(f"{res.plural} {key[2]!r} already exists")
            self._commit(*key, None, obj)
            return 201, copy.deepcopy(self.store[key])
        if name is None:
            raise KubernetesError(status=405, reason="MethodNotAllowed", message=f"{method} needs a name")
        key = (res_key, namespace, name)
        current = self.store.get(key)
        if method == "DELETE":
            if current is None:
                raise _not_found(f"{res.plural} {name!r}")
            uid = ((data or {}).get("preconditions") or {}).get("uid") if isinstance(data, dict) else None
            if uid and uid != current["metadata"]["uid"]:
                raise _conflict("precondition failed: uid mismatch")
            return 200, copy.deepcopy(self._delete(*key))
        if method == "PUT":
            if current is None:
                raise _not_found(f"{res.plural} {name!r}")
            rv = (data.get("metadata") or {}).get("resourceVersion")
            if rv and rv != current["metadata"]["resourceVersion"]:
                raise _conflict("the object has been modified; please apply your changes to the latest version")
            new = self._preserve_server_fields(current, copy.deepcopy(data), sub, info)
            self._commit(*key, current, new)
            return 200, copy.deepcopy(self.store.get(key, new))
        # PATCH
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        if content_type == "application/apply-patch+yaml":
            return self._apply(res, key, current, request, info)
        if current is None:
            raise _not_found(f"{res.plural} {name!r}")
        precondition = ((data or {}).get("metadata") or {}).get("resourceVersion") if isinstance(data, dict) else None
        if precondition and precondition != current["metadata"]["resourceVersion"]:
            raise _conflict("the object has been modified; please apply your changes to the latest version")
        try:
            if content_type == "application/json-patch+json":
                patched = jsonpatch.apply_patch(current, data, in_place=False)
            else:  # merge-patch+json; strategic-merge-patch+json approximated as a merge
                patched = merge_patch(current, data)
        except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict, jsonpatch.JsonPointerException) as exc:
            raise KubernetesError(status=422, reason="Invalid", message=f"the patch cannot be applied: {exc}") from exc
        new = self._preserve_server_fields(current, patched, sub, info)
        self._commit(*key, current, new)
        return 200, copy.deepcopy(self.store.get(key, new))

    def _preserve_server_fields(self, current: dict, new: dict, sub: str | None, info: ResourceInfo) -> dict:
        """What a client may not change: identity fields; status vs. the rest per subresource."""
        out = copy.deepcopy(new)
        meta = out.setdefault("metadata", {})
        for field_name in ("uid", "creationTimestamp", "generation", "resourceVersion", "name", "namespace"):
            if field_name in current["metadata"]:
                meta[field_name] = current["metadata"][field_name]
            else:
                meta.pop(field_name, None)
        if current["metadata"].get("deletionTimestamp"):
            meta["deletionTimestamp"] = current["metadata"]["deletionTimestamp"]
        if "status" in info.subresources:
            if sub == "status":  # only the status moves
                status = out.get("status")
                out = copy.deepcopy(current)
                if status is None:
                    out.pop("status", None)
                else:
                    out["status"] = status
            elif "status" in current:
                out["status"] = copy.deepcopy(current["status"])
            else:
                out.pop("status", None)
        return out

    def _apply(self, res: resource, key: tuple, current: dict | None, request: Any, info: ResourceInfo) -> tuple:
        data = request.data
        if not isinstance(data, dict):
            data = yaml.safe_load(request.text)
        manager = request.params.get("fieldManager")
        if not manager:
            raise KubernetesError(status=400, reason="BadRequest", message="fieldManager is required for apply")
        applied_key = (*key, manager)
        dry_run = request.params.get("dryRun") == "All"  # validated as a write, stored nowhere
        if current is None:
            obj = self._new_object(res, key[1], data)
            if dry_run:
                return 201, obj
            self._commit(*key, None, obj)
            self.applied[applied_key] = copy.deepcopy(data)
            return 201, copy.deepcopy(self.store[key])
        patch = merge_patch(removals(self.applied.get(applied_key, {}), data) or {}, data)
        new = self._preserve_server_fields(current, merge_patch(current, patch), request.subresource, info)
        if dry_run:
            return 200, new
        self.applied[applied_key] = copy.deepcopy(data)
        self._commit(*key, current, new)
        return 200, copy.deepcopy(self.store.get(key, new))

    # -- assertions --------------------------------------------------------------------------------

    def writes(self) -> list[str]:
        """Every write request so far, as 'METHOD /path' (dry runs are no writes)."""
        return [
            f"{_method(r)} {r.url.path}"
            for r in list(self.log)
            if _method(r) in WRITE_METHODS and r.params.get("dryRun") != "All"
        ]

    def calls(self) -> list[Call]:
        """Every resource request so far."""
        return [
            Call(
                method=_method(r),
                group=r.resource.group,
                resource=r.resource.plural + (f"/{r.subresource}" if r.subresource else ""),
                name=r.name,
                namespace=r.namespace,
                params=dict(r.params),
                content_type=r.headers.get("Content-Type", ""),
                user_agent=r.headers.get("User-Agent", ""),
            )
            for r in list(self.log)
            if r.resource is not None and r.resource.plural is not None
        ]


@dataclass(frozen=True)
class Call:
    method: str
    group: str
    resource: str  # plural, or plural/subresource
    name: str | None
    namespace: str | None  # None: cluster-wide (a list or watch of all namespaces, or a cluster-scoped kind)
    params: dict[str, str]
    content_type: str
    user_agent: str


def _method(request: Any) -> str:
    return str(getattr(request.method, "value", request.method)).upper()


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


INFERENCE_SERVICES = "llmfleet.io/v1alpha1/inferenceservices"
POD_MONITORS = "monitoring.coreos.com/v1/podmonitors"
LEADER_WORKER_SETS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
CLUSTER_PEERINGS = "kopf.dev/v1/clusterkopfpeerings"


def make_cluster(*, pod_monitor: bool = False, peering: bool = False, leader_worker_set: bool = False) -> Cluster:
    cluster = Cluster()
    with warnings.catch_warnings():  # kmock reads its bundle with a deprecated importlib call
        warnings.simplefilter("ignore", DeprecationWarning)
        cluster.resources.load_bundled()
    verbs = {"get", "list", "watch", "create", "update", "patch", "delete"}
    cluster.declare(
        INFERENCE_SERVICES,
        ResourceInfo(
            kind="InferenceService",
            singular="inferenceservice",
            namespaced=True,
            verbs=verbs,
            shortnames={"llmis", "llmsvc"},
            categories={"llm-fleet"},
            subresources={"status"},
        ),
    )
    if pod_monitor:
        info = ResourceInfo(kind="PodMonitor", singular="podmonitor", namespaced=True, verbs=verbs)
        cluster.declare(POD_MONITORS, info)
    if leader_worker_set:  # lws.sigs.k8s.io's CRD: groups of pods, with status and scale subresources
        info = ResourceInfo(
            kind="LeaderWorkerSet",
            singular="leaderworkerset",
            namespaced=True,
            verbs=verbs,
            shortnames={"lws"},
            subresources={"status", "scale"},
        )
        cluster.declare(LEADER_WORKER_SETS, info)
    if peering:  # the chart's crds/kopf-peering.yaml: keep-alives go into the object's status
        info = ResourceInfo(kind="ClusterKopfPeering", singular="clusterkopfpeering", namespaced=False, verbs=verbs)
        cluster.declare(CLUSTER_PEERINGS, info)
    return cluster


@dataclass
class RunningCluster:
    """The emulator served on a loopback port from its own thread and event loop."""

    cluster: Cluster
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    url: str
    _stop: asyncio.Event | None = None
    errors: list[BaseException] = field(default_factory=list)

    def call(self, fn: Any, timeout: float = 10) -> Any:
        """Run fn() inside the emulator's loop (its state is only touched there)."""

        async def wrapper() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(timeout)

    def stop(self) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(timeout=10)


def serve(cluster: Cluster) -> RunningCluster:
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        stop = asyncio.Event()
        box["stop"] = stop
        async with cluster, Server(cluster) as server:
            box["url"] = str(server.url).rstrip("/")
            started.set()
            await stop.wait()

    def target() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # surfaced by the fixture
            box["error"] = exc
            started.set()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=target, name="kube-emulator", daemon=True)
    thread.start()
    started.wait(10)
    if "error" in box:
        raise box["error"]
    return RunningCluster(cluster=cluster, loop=loop, thread=thread, url=box["url"], _stop=box["stop"])


def kubeconfig(url: str) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": url}}],
            "users": [{"name": "tester", "user": {"token": "test-token"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
            "current-context": "emulator",
        }
    )


__all__ = ["Call", "Cluster", "Fault", "RunningCluster", "Stall", "kubeconfig", "make_cluster", "serve"]
