"""Keep the garbage collector's full passes off what a server built at start-up.

A serving process holds some 400,000 objects the collector tracks once torch, transformers and
the HTTP layer are imported and the model is loaded, and nearly all of them live as long as the
process. CPython's full (oldest-generation) collection walks every one of them: about 180 ms on
builtin:small's server on a 2-core CPU, during which no step runs and no token streams.
``freeze_startup_heap`` moves what exists once start-up is done into the collector's permanent
generation, so the full passes that serving still triggers walk only what came after, as vLLM's
engine core and API server do (its ``freeze_gc_heap``). Cycles among the frozen objects are
never collected; start-up's are collected just before the freeze.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect start-up's garbage, then freeze what is left; the count of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
