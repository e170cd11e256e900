"""SlotPool: never-used slots in increasing order, then freed slots last-freed-first."""

from __future__ import annotations

import pytest

from kvtriton.manager import SlotPool


def test_slot_pool_hands_out_fresh_slots_in_increasing_order() -> None:
    pool = SlotPool(5)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.num_free == 0


def test_slot_pool_reuses_freed_slots_last_freed_first_after_the_fresh_ones() -> None:
    pool = SlotPool(4)
    pool.allocate(3)
    pool.release(0)
    pool.release_many([2, 1])
    assert pool.num_free == 4
    assert pool.allocate(3) == [3, 1, 2]
    assert pool.allocate(1) == [0]


def test_slot_pool_refuses_more_than_it_has_and_takes_nothing() -> None:
    pool = SlotPool(2)
    pool.allocate(1)
    with pytest.raises(ValueError, match=r"n must be in 0\.\.1 \(the free slots\), got 2"):
        pool.allocate(2)
    assert pool.allocate(1) == [1]


def test_slot_pool_reset_makes_every_slot_fresh_again() -> None:
    pool = SlotPool(3)
    pool.allocate(3)
    pool.release(1)
    pool.reset()
    assert (pool.num_free, pool.allocate(3)) == (3, [0, 1, 2])
