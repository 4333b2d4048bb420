"""Going on without a terminal: after a hang-up (the terminal window closed), every write to it
fails, and the fleet's next log line or screen refresh would end the process with the drain
still under way. Standard input, output and error are pointed at /dev/null instead."""

from __future__ import annotations

import os


def detach_from_terminal() -> None:
    """Replace file descriptors 0, 1 and 2 with /dev/null (writes to them then succeed, unseen)."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in (0, 1, 2):
            os.dup2(null, fd)
    finally:
        os.close(null)
