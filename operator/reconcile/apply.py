"""Apply the desired objects idempotently: write only what differs, prune what is no longer wanted.

Per object: a server-side apply (field manager ``llm-fleet-operator``) when the live object is
missing or differs, and nothing at all when it already matches. "Matches" means every field we
set has our value in the live object (the API server adds defaults around them) and the live
object carries the hash of exactly what we would apply now: the hash catches a field we stopped
setting, which the subset test cannot see. Objects we own (controller reference with our uid)
that are no longer desired, e.g. the colocated pool after a switch to disaggregated, are deleted
(once the new pools serve: handover.py).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from llmfleet.operator.reconcile.cluster import ApiError, KubeClient, ResourceKind, kind_of
from llmfleet.operator.reconcile.desired import EXTERNAL, REPLICAS_OWNER

APPLIED_HASH = "llmfleet.io/applied-hash"

_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")
_SUFFIX = {
    None: Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}


class OwnershipConflict(Exception):
    """A same-named object exists that we do not control (another controller's, or nobody's): we
    must not take it over."""


def quantity(value: Any) -> Decimal | None:
    """A Kubernetes resource quantity's value ("500m", "32Gi", 1), or None if it is not one."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return None
    match = _QUANTITY.match(str(value).strip())
    if not match:
        return None
    try:
        return Decimal(match.group(1)) * _SUFFIX[match.group(2)]
    except ArithmeticError:  # InvalidOperation, or Overflow: a hex hash such as "4711e90210987654"
        return None


def is_subset(want: Any, have: Any) -> bool:
    """Every field in `want` has the same value in `have` (which may hold more: server defaults).
    Lists must match item by item; quantities compare by value ("1" == 1, "0.5" == "500m"). A zero
    value (false, "", {}, []) also matches an absent field: the API server does not store those
    (Go's omitempty), e.g. ``readOnly: false`` or a toleration's ``value: ""``."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(
            is_subset(v, have[k]) if k in have else _is_zero(v) for k, v in want.items()
        )
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(is_subset, want, have))
    if want == have and type(want) is type(have):
        return True
    if isinstance(want, int | float) and isinstance(have, int | float) and not isinstance(want, bool):
        return want == have
    a, b = quantity(want), quantity(have)
    return a is not None and a == b


def differing_fields(want: Any, have: Any, path: str = "") -> list[str]:
    """The dotted paths of the fields in `want` that `have` does not match (is_subset, field by
    field; a list is one field)."""
    if not (isinstance(want, dict) and isinstance(have, dict)):
        return [] if is_subset(want, have) else [path]
    out: list[str] = []
    for key, value in want.items():
        at = f"{path}.{key}" if path else key
        if key in have:
            out += differing_fields(value, have[key], at)
        elif not _is_zero(value):
            out.append(at)
    return out


def _is_zero(value: Any) -> bool:
    return value is False or value in ("", {}, [])


def content_hash(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def with_applied_hash(obj: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    hashed = obj
    if (obj["metadata"].get("annotations") or {}).get(REPLICAS_OWNER) == EXTERNAL:  # they move without us
        hashed = copy.deepcopy(obj)
        hashed["spec"].pop("replicas", None)
    out["metadata"].setdefault("annotations", {})[APPLIED_HASH] = content_hash(hashed)
    return out


def _applied_hash(obj: dict[str, Any]) -> str | None:
    return (obj["metadata"].get("annotations") or {}).get(APPLIED_HASH)


def controller_uid(obj: dict[str, Any]) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def ref(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


@dataclass
class ApplyResult:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    # objects edited outside the operator since it last applied them, and set back: "Kind/name: fields"
    reverted: list[str] = field(default_factory=list)
    live: dict[str, dict[str, Any]] = field(default_factory=dict)  # "Kind/name" -> object as it is now

    @property
    def changed(self) -> bool:
        return bool(self.created or self.updated or self.deleted)

    def summary(self) -> str:
        parts = [
            f"{verb} {', '.join(refs)}"
            for verb, refs in (("created", self.created), ("updated", self.updated), ("deleted", self.deleted))
            if refs
        ]
        return "; ".join(parts) or "no changes"


async def list_children(
    client: KubeClient, namespace: str, selector: dict[str, str], kinds: tuple[ResourceKind, ...]
) -> dict[str, dict[str, Any]]:
    """The children selected by `selector`, "Kind/name" -> object: one list per kind, no GETs."""
    live: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        for obj in await client.list(kind, namespace, selector):
            live[ref(obj)] = obj
    return live


async def apply_all(
    client: KubeClient,
    namespace: str,
    owner_uid: str,
    live: dict[str, dict[str, Any]],
    desired: list[dict[str, Any]],
    *,
    prune: bool = True,
) -> ApplyResult:
    """Bring the children listed in `live` (list_children) to exactly `desired`; with
    prune=False, the ones no longer desired stay (a mode switch still serving from them).

    Writes happen only on a difference. Raises OwnershipConflict before writing anything if a
    desired name belongs to someone else. When an edit changes several existing objects, each is
    first applied as a dry run (validated and admitted, not stored): an object the API server
    refuses (a bad env entry or affinity in the pod options) raises before any lands, instead of
    leaving the others changed (a ConfigMap whose knobs the pods apply live, beside the old
    Deployment). New objects are not dry-run: one may name another not created yet (a binding's
    Role), and a half-created fleet is completed by the next pass anyway.
    """
    result = ApplyResult()
    live = dict(live)
    wanted = [with_applied_hash(obj) for obj in desired]
    for obj in wanted:
        current = live.get(ref(obj))
        if current is None:  # not labelled as ours: maybe a same-named foreign object
            current = await client.get(kind_of(obj), namespace, obj["metadata"]["name"])
            if current is not None:
                live[ref(obj)] = current
        if current is None:
            continue
        owner = controller_uid(current)
        if owner is None:  # made by hand or another tool (a vLLM Service being migrated): never ours to take
            raise OwnershipConflict(
                f"{ref(obj)} exists and no InferenceService controls it; llm-fleet does not take it over: "
                "delete it or rename the InferenceService"
            )
        if owner != owner_uid:
            raise OwnershipConflict(f"{ref(obj)} exists and is controlled by another owner (uid {owner})")

    changed = []
    for obj in wanted:
        current = live.get(ref(obj))
        if current is not None and is_subset(obj, current):
            result.live[ref(obj)] = current
        else:
            changed.append((obj, current))
    updates = [obj for obj, current in changed if current is not None]
    if len(changed) > 1:
        for obj in updates:
            await client.apply(obj, dry_run=True)
    for obj, current in changed:
        if current is not None and _applied_hash(current) == _applied_hash(obj):  # ours unchanged: an edit
            result.reverted.append(f"{ref(obj)}: {', '.join(differing_fields(obj, current))}")
        result.live[ref(obj)] = await client.apply(obj)
        (result.updated if current is not None else result.created).append(ref(obj))

    if not prune:
        return result
    wanted_refs = {ref(obj) for obj in wanted}
    for key, obj in live.items():
        if key not in wanted_refs and controller_uid(obj) == owner_uid:
            meta = obj["metadata"]
            try:
                await client.delete(kind_of(obj), namespace, meta["name"], meta.get("uid"))
            except ApiError as exc:
                if exc.status != 404:
                    raise
            result.deleted.append(key)
    return result
