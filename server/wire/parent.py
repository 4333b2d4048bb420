"""A server started by another process (the local fleet) drains and exits once that process is
gone, killed beyond its own clean-up, rather than live on unowned."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger("llmfleet.drain")

# The pid of the process that started this server, where one did
PARENT_PID_ENV = "LLMFLEET_PARENT_PID"
_PARENT_POLL_S = 1.0


def exit_with_parent() -> None:
    """Drain (SIGTERM to ourselves) once the process named by ``PARENT_PID_ENV`` is no longer
    our parent: its death re-parents us."""
    parent = os.environ.get(PARENT_PID_ENV, "")
    if not parent.isdigit():
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(_PARENT_POLL_S)
        log.warning("process %s, which started this server, is gone: draining", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
