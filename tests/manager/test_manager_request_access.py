"""The request record (kvtriton/manager/_request_access.py): what a finished request tells its policy.

The record keeps, per request, the keys in first-seen order with their
positions and the sets of keys it reused, inserted and learnt a store miss
from; at the end its ``runs`` cut the keys, head to tail, into runs of one use.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtriton._keys import OffloadKey, make_offload_key
from kvtriton.manager._request_access import RequestAccess
from kvtriton.manager.policies._base import KeyRun, Use

# One access: a load (True) of ready keys, or a store offer (False) of keys
# new (True) or ready (False) to the cache, whose store allocated (True) or
# was refused (False).
Access = tuple[bool, list[bool], bool]
accesses = st.lists(
    st.tuples(st.booleans(), st.lists(st.booleans(), min_size=1, max_size=5), st.booleans()),
    max_size=8,
)


def flat(runs: list[KeyRun]) -> list[tuple[OffloadKey, Use]]:
    return [(key, use) for keys, use in runs for key in keys]


def no_position(key: OffloadKey) -> int | None:
    del key
    return None


def replay(access: RequestAccess, script: list[Access]) -> tuple[list[OffloadKey], list[Use]]:
    """Make the script's accesses, each on keys the request has not seen, as the manager records them.

    Returns the keys in first-seen order and the use each must end with.
    """
    seen: list[OffloadKey] = []
    expected: list[Use] = []
    for is_load, pattern, stored in script:
        keys = [make_offload_key(f"k{len(seen) + i}".encode()) for i in range(len(pattern))]
        new, _ = access.observe(keys, no_position)
        assert new is keys  # all first seen: recorded as named
        if is_load:
            access.reuse(keys)
            expected.extend(Use.REUSED for _ in keys)
        else:
            new_keys = [key for key, is_new in zip(keys, pattern) if is_new]
            access.reuse([key for key, is_new in zip(keys, pattern) if not is_new])
            if new_keys:
                assert access.store_misses(new_keys) == new_keys  # all first seen: none learnt from yet
                if stored:
                    access.inserted.update(new_keys)
            new_use = Use.INSERTED if stored else Use.SEEN
            expected.extend(new_use if is_new else Use.REUSED for is_new in pattern)
        seen.extend(keys)
    return seen, expected


@settings(max_examples=200, deadline=None)
@given(accesses)
def test_each_key_ends_with_its_use_in_runs_of_one_use(script: list[Access]) -> None:
    access = RequestAccess(owner=None, generation=0)
    keys, expected = replay(access, script)
    runs = access.runs(keys)
    assert flat(runs) == list(zip(keys, expected))
    assert keys == list(access.positions)
    # Consecutive runs differ in use: neighbours of one use are one run.
    assert all(a[1] is not b[1] for a, b in zip(runs, runs[1:]))


def test_an_access_that_names_a_key_again_records_it_once() -> None:
    access = RequestAccess(owner=None, generation=0)
    a, b, c = (make_offload_key(name) for name in (b"a", b"b", b"c"))
    keys = [a, b]
    access.observe(keys, no_position)
    access.reuse(keys)
    assert access.runs([a, b]) == [([a, b], Use.REUSED)]
    new, _ = access.observe([b, c], no_position)  # b again
    assert new == [c]
    assert access.store_misses([b, c]) == [b, c]
    assert access.reused == {a, b}
    access.inserted.update([b, c])
    assert access.store_misses([c]) == []  # learnt from once per request
    access.reuse([c])  # the request reads back a key it inserted (a tier's cascade): not a reuse
    assert flat(access.runs([a, b, c])) == [
        (a, Use.REUSED),
        (b, Use.REUSED),  # reused before this request stored it again: a reuse, as vLLM counts it
        (c, Use.INSERTED),
    ]
