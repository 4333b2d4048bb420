"""Asking for servers when a pool has none: the one annotation a router writes on its fleet's
wake ConfigMap and the operator answers by scaling the pools at zero back to one at once, not at
the tuner's next run. The value is the time of the request (RFC 3339, UTC, milliseconds), so
each request is a change the operator's watch sees."""

from __future__ import annotations

from datetime import UTC, datetime

WAKE_ANNOTATION = "llmfleet.io/wake-requested-at"


def wake_stamp(at: datetime | None = None) -> str:
    """The annotation's value for a request made ``at`` (now by default)."""
    return (at or datetime.now(UTC)).astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_wake_stamp(value: str | None) -> datetime | None:
    """The time a wake annotation carries; None for a missing or unreadable one."""
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)
