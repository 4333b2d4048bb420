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

A step also makes and frees thousands of small objects (tensors and their metadata, the
scheduler's), which tcmalloc serves from per-thread caches faster than glibc's malloc does, as
vLLM's CPU guide and PyTorch's tuning guide say. A process gets it only from the start, through
``LD_PRELOAD``: ``ask_for_tcmalloc`` puts it there for a process to come, and
``restart_under_tcmalloc`` starts the engine's commands again under it, where the system has the
library (Debian's ``libtcmalloc-minimal4``) and the user did not choose otherwise.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest accepted value on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30

HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"  # read once by torch, when it is imported

TCMALLOC_ENV = "LLMFLEET_TCMALLOC"  # "0": keep the C library's malloc; a path: the library to preload
TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")  # gperftools' libraries, the allocator alone first
# tcmalloc reports every allocation over 1 GiB on stderr, and a KV cache is one
LARGE_ALLOC_REPORT_ENV = "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"
_OFF = {"0", "off", "false", "no"}

_applied: bool | None = None


def ask_for_huge_pages(env: dict[str, str] | None = None) -> dict[str, str]:
    """Ask torch for transparent huge pages in ``env`` (default: this process's environment, which
    must not have imported torch yet), unless it already says; returns ``env``."""
    target = os.environ if env is None else env
    target.setdefault(HUGE_PAGES_ENV, "1")
    return target


def tcmalloc_library(env: dict[str, str]) -> str | None:
    """The tcmalloc to preload: the one ``LLMFLEET_TCMALLOC`` names, else the system's (by its
    soname, which the loader finds as it finds any library); None where there is none, the user
    turned it off, or the loader is not Linux's (which alone reads ``LD_PRELOAD``)."""
    choice = env.get(TCMALLOC_ENV, "").strip()
    if choice.lower() in _OFF or not sys.platform.startswith("linux"):
        return None
    if choice:
        return choice
    return next((found for name in TCMALLOC_NAMES if (found := ctypes.util.find_library(name))), None)


def ask_for_tcmalloc(env: dict[str, str]) -> dict[str, str]:
    """Put tcmalloc first on ``LD_PRELOAD`` in ``env``, for a process started with it, unless
    ``LD_PRELOAD`` already names an allocator (tcmalloc, jemalloc, mimalloc: the user's choice)
    or the library to preload (from an earlier start), or there is none; returns ``env``."""
    preload = env.get("LD_PRELOAD", "")
    if "malloc" in preload:
        return env
    library = tcmalloc_library(env)
    if library is None or library in preload.replace(":", " ").split():  # the loader splits on either
        return env
    env["LD_PRELOAD"] = f"{library}:{preload}" if preload else library
    env.setdefault(LARGE_ALLOC_REPORT_ENV, str(1 << 40))
    return env


def restart_under_tcmalloc(command: list[str]) -> None:
    """Replace this process with ``command`` under tcmalloc, where ``ask_for_tcmalloc`` would
    add it to this process's environment; else return. The restarted process's ``LD_PRELOAD``
    names it, so it goes on from here. Call it before any thread starts."""
    env = dict(os.environ)
    before = env.get("LD_PRELOAD")
    if ask_for_tcmalloc(env).get("LD_PRELOAD") == before:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, env)


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
