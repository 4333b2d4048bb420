"""The start-up heap leaves the collector's full passes (server/gc_heap.py)."""

from __future__ import annotations

import gc
import weakref


class _Node:
    pass


def test_what_start_up_built_is_frozen_and_what_comes_after_is_not():
    from llmfleet.server.gc_heap import freeze_startup_heap

    built = [["weights"]]  # stands for what start-up made and serving keeps
    cycle = _Node()
    cycle.itself = cycle  # garbage start-up left behind in a cycle
    left = weakref.ref(cycle)
    del cycle
    try:
        frozen = freeze_startup_heap()
        # Frozen objects another thread of the test process frees meanwhile leave the count.
        assert 0 < gc.get_freeze_count() <= frozen
        later = [["request"]]  # made while serving
        walked = {id(o) for o in gc.get_objects()}  # what a full collection walks
        assert id(built) not in walked and id(later) in walked
        assert left() is None  # collected before the freeze, not kept forever
    finally:
        gc.unfreeze()
