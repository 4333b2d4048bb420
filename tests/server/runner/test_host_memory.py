"""CPU steps keep the memory they free: a prompt step must not page-fault its buffers in again."""

from __future__ import annotations

import platform
import resource

import numpy as np
import pytest

from llmfleet.server.runner.host_memory import keep_freed_host_memory

MB = 1 << 20


def one_step() -> int:
    """A prompt step's allocations: 48 activation buffers of 1-1.2 MB alive at once, then all
    freed. Returns the bytes it touched."""
    buffers = [np.empty(MB + 4096 * i, dtype=np.uint8) for i in range(48)]
    for buffer in buffers:
        buffer.fill(1)
    return sum(b.nbytes for b in buffers)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
def test_a_second_step_reuses_the_pages_the_first_one_freed() -> None:
    assert keep_freed_host_memory() and keep_freed_host_memory()  # once per process, then cached
    one_step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    touched = one_step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # glibc's own thresholds: 13,400 faults here (each buffer mapped afresh); kept, none
    assert faults < 0.05 * touched / resource.getpagesize()
