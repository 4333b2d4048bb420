"""How busy the machine was while a benchmark ran: other processes on a small machine slow the
engine down, and a timing taken under contention says little about the engine.

Linux's pressure stall information (``/proc/pressure/cpu``, the ``some`` line) counts the time at
least one runnable task waited for a CPU. A benchmark alone on the machine keeps it near zero
(its threads match the cores); another busy process raises it. Where the file is missing
(macOS, old kernels) the measurement is ``None``.
"""

from __future__ import annotations

import time
from pathlib import Path

PRESSURE = Path("/proc/pressure/cpu")


def _stall_us() -> float | None:
    try:
        first = PRESSURE.read_text().splitlines()[0]  # some avg10=.. avg60=.. avg300=.. total=<us>
    except (OSError, IndexError):
        return None
    fields = dict(part.split("=", 1) for part in first.split()[1:])
    return float(fields["total"])


class CPUPressure:
    """``with CPUPressure() as p: ...`` then ``p.share``: the fraction of the block's wall time
    some task waited for a CPU (None where unmeasurable)."""

    def __init__(self) -> None:
        self.share: float | None = None

    def __enter__(self) -> CPUPressure:
        self._stall = _stall_us()
        self._start = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        end = _stall_us()
        elapsed = time.monotonic() - self._start
        if self._stall is not None and end is not None and elapsed > 0:
            self.share = (end - self._stall) / 1e6 / elapsed


def wait_quiet(threshold: float = 0.05, window_s: float = 5.0, max_wait_s: float = 120.0) -> float | None:
    """Wait (up to ``max_wait_s``) until CPU pressure over ``window_s`` drops below ``threshold``.
    Returns the last share measured (None where unmeasurable)."""
    deadline = time.monotonic() + max_wait_s
    while True:
        with CPUPressure() as p:
            time.sleep(window_s)
        if p.share is None or p.share < threshold or time.monotonic() >= deadline:
            return p.share


def describe(share: float | None) -> str:
    return "unmeasured" if share is None else f"{share:.0%}"
