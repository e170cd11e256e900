"""The request record's two forms (kvtriton/manager/_request_access.py) tell a policy the same thing.

While every access of a request names only keys it has not seen, the record
keeps the accesses as runs of one use and hashes nothing twice; the first
access that names a key again turns them into the sets. Whichever form the
record is in when the request finishes, the policy must get the same keys
with the same uses.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtriton._keys import OffloadKey, make_offload_key
from kvtriton.manager._request_access import RequestAccess
from kvtriton.manager.policies._base import Block, KeyRun, Use

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


def replay(access: RequestAccess, script: list[Access]) -> list[OffloadKey]:
    """Make the script's accesses, each on keys the request has not seen; the keys in first-seen order."""
    seen: list[OffloadKey] = []
    ready_block = Block(0, ref_cnt=0)
    for is_load, pattern, stored in script:
        keys = [make_offload_key(f"k{len(seen) + i}".encode()) for i in range(len(pattern))]
        new, _ = access.observe(keys, no_position)
        fresh = new is keys
        assert fresh
        if is_load:
            access.reuse(keys, fresh)
        else:
            blocks: list[Block | None] = [None if is_new else ready_block for is_new in pattern]
            new_keys = [key for key, block in zip(keys, blocks) if block is None]
            if new_keys:
                assert access.store_misses(new_keys, fresh) == new_keys  # all first seen: none learnt from yet
            access.offer(keys, blocks, fresh, stored=stored)
        seen.extend(keys)
    return seen


@settings(max_examples=200, deadline=None)
@given(accesses)
def test_the_runs_and_the_sets_give_the_policy_the_same_uses(script: list[Access]) -> None:
    as_runs = RequestAccess(owner=None, generation=0)
    keys = replay(as_runs, script)
    as_sets = RequestAccess(owner=None, generation=0)
    replay(as_sets, script)
    as_sets.to_sets()
    assert as_runs.run_ends is not None and as_runs.uses is None  # only fresh accesses: still runs
    assert as_sets.run_ends is None
    from_runs = as_runs.head_to_tail_runs(keys, first_seen=True)
    from_sets = as_sets.head_to_tail_runs(keys, first_seen=False)
    assert flat(from_runs) == flat(from_sets)
    assert [key for key, _ in flat(from_runs)] == keys == list(as_runs.positions)
    # Consecutive runs differ in use (the sets' form merges neighbours).
    assert all(a[1] is not b[1] for a, b in zip(from_sets, from_sets[1:]))


def test_an_access_that_names_a_key_again_turns_the_runs_into_sets() -> None:
    access = RequestAccess(owner=None, generation=0)
    a, b, c = (make_offload_key(name) for name in (b"a", b"b", b"c"))
    keys = [a, b]
    new, _ = access.observe(keys, no_position)
    access.reuse(keys, new is keys)
    assert access.head_to_tail_runs([a, b], first_seen=True) == [([a, b], Use.REUSED)]
    new, _ = access.observe([b, c], no_position)  # b again
    assert new == [c]
    assert access.store_misses([b, c], fresh=False) == [b, c]
    assert access.run_ends is None
    uses = access.to_sets()
    assert uses.reused == {a, b}
    access.offer([b, c], [None, None], False, stored=True)
    assert uses.inserted == {b, c}
    assert access.store_misses([c], fresh=False) == []  # learnt from once per request
    assert flat(access.head_to_tail_runs([a, b, c], first_seen=True)) == [
        (a, Use.REUSED),
        (b, Use.REUSED),  # reused before this request stored it again: a reuse, as vLLM counts it
        (c, Use.INSERTED),
    ]
