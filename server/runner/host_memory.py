"""Keep the memory a CPU step frees for the next step instead of handing it back to the kernel.

glibc's malloc serves large blocks with ``mmap`` and trims the free top of its heap back to the
kernel, with thresholds it adapts to the sizes it has seen. A CPU engine's steps alternate
between decodes, which allocate little, and prompt chunks, which allocate tens to hundreds of MB
of activations of a size never seen before. So each chunk after a run of decodes gets fresh
pages and faults every one of them in: on builtin:small in bfloat16 (2-core CPU), a 300-token
chunk took 26,000 minor page faults; with the memory kept, about 1,100. Raising both thresholds
(mmap for blocks up to glibc's 32 MiB maximum, trimming only past 1 GiB of free heap) keeps the
pages mapped; the process holds at most its largest step's working set. On other C libraries
(musl, macOS) nothing changes.

The weights and the KV cache are read from DRAM at every decode step, and the KV blocks of a
step lie anywhere in the cache: with 4 KiB pages nearly every block costs a TLB miss. torch backs
its large CPU allocations with 2 MiB transparent huge pages when ``THP_MEM_ALLOC_ENABLE=1`` is set
before it is imported, on kernels that grant them on request (``madvise``, the common default);
``ask_for_huge_pages`` sets it unless the user chose (the gain: docs/engine.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest accepted value on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30

HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"  # read once by torch, when it is imported

_applied: bool | None = None


def ask_for_huge_pages(env: dict[str, str] | None = None) -> dict[str, str]:
    """Ask torch for transparent huge pages in ``env`` (default: this process's environment, which
    must not have imported torch yet), unless it already says; returns ``env``."""
    target = os.environ if env is None else env
    target.setdefault(HUGE_PAGES_ENV, "1")
    return target


def keep_freed_host_memory() -> bool:
    """Set glibc's malloc to keep freed memory mapped (once per process); False where it is
    not glibc or refuses the setting."""
    global _applied
    if _applied is None:
        _applied = _set_thresholds()
    return _applied


def _set_thresholds() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018  (present in glibc only: musl also has a mallopt that does nothing)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    if not applied:
        log.warning("glibc refused the malloc thresholds: CPU prompt steps will page-fault their buffers")
    return applied
