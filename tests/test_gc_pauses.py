"""The engine process's garbage collector: the start-up heap frozen out of its walks, every
collection counted and timed (gc_pauses.py)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from tandem.service.engine.gc_pauses import GcPauses, freeze_start_up_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def frozen() -> Iterator[int]:
    count = freeze_start_up_heap()
    yield count
    gc.unfreeze()  # this process runs other tests: give their objects back to the collector


def test_freezing_takes_the_live_heap_out_of_every_walk(frozen: int):
    walked = len(gc.get_objects())  # what a full collection walks now (the frozen are not listed)
    assert frozen > 10_000  # torch, transformers, pytest: far more than a step makes
    assert walked < frozen / 20


def test_cycles_made_after_the_freeze_are_still_collected(frozen: int):
    a, b = Node(), Node()
    a.other, b.other = b, a
    alive = weakref.ref(a)
    del a, b
    gc.collect()
    assert alive() is None


def test_each_collection_is_counted_and_timed_by_generation():
    with GcPauses(frozen_objects=123) as pauses:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        totals = pauses.totals()
    assert totals.collections[2] == 2 and totals.collections[0] >= 1  # more gen-0 may run on their own
    assert all(s > 0 for g, s in enumerate(totals.seconds) if totals.collections[g])
    assert totals.frozen_objects == 123  # as the freeze reported it
    gc.collect(2)  # uninstalled: not counted
    assert pauses.totals().collections[2] == 2
    assert pauses._on_collection not in gc.callbacks
