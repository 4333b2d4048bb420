"""What the router knows of one server's load, and the score it ranks servers by. Pure: the
router (in the cluster and on the local fleet's client port) and the simulator all rank by it."""

from __future__ import annotations

from dataclasses import dataclass

# A request still waiting for its first token weighs four that decode: a new prompt queues behind
# the prefills ahead of it, while decoding sequences only share the steps with it.
UNSTARTED_WEIGHT = 3.0
# A server near a full KV cache preempts (recomputes) and slows everyone on it, worth several
# queued requests.
KV_WEIGHT = 4.0


def load_score(in_flight: float, unstarted: float, kv_usage: float) -> float:
    """How far back a new request would stand on a server, in decoding requests: those it
    holds, ``UNSTARTED_WEIGHT`` more for each that has yet to produce its first token, and its KV
    usage (0..1). The router and the simulator rank servers by it."""
    return in_flight + UNSTARTED_WEIGHT * unstarted + KV_WEIGHT * kv_usage


@dataclass
class Server:
    url: str
    pool: str
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    assigned: int = 0  # requests this router sent and that have not finished yet
    unstarted: int = 0  # of those, the ones whose first token (or whole answer) has not come yet
    others: int = 0  # requests the last poll found beyond this router's own: other routers'
    healthy: bool = True  # a new server is tried at once; a failure sets it aside until a poll succeeds
    draining: bool = False  # its /load says so: it takes no new request
    unreachable: bool = False  # a connection to it failed since its last good poll (it exited, say)
    failures: int = 0  # requests and polls that failed here
    poll_failures: int = 0  # of those, the /load polls: the server itself, not one request's trouble
    slow_polls: int = 0
    polling: bool = False
    polled_at: float | None = None

    @property
    def score(self) -> float:
        return load_score(self.assigned + self.others, self.unstarted, self.kv_usage)

    def hold(self, n: int) -> None:
        """Count ``n`` (+1 or -1) requests sent here that have yet to produce their first token."""
        self.assigned += n
        self.unstarted += n

    def as_dict(self) -> dict:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "draining": self.draining,
            "waiting": self.waiting,
            "running": self.running,
            "kv_usage": round(self.kv_usage, 4),
            "assigned": self.assigned,
            "unstarted": self.unstarted,
        }
