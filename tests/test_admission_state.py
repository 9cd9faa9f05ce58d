"""Exact admission: a key gets a row at exactly its admit_after-th sighting.

The reference is a dict of sightings. Streams are crowded enough that the
count-min sketch used before (4 rows of 1024 counters at this capacity)
would have admitted some once-seen keys early: `_sketch_estimates` rebuilds
its estimates to show that those keys are in the stream.
"""

import numpy as np
import pytest

from keras_sparse.table import HashTable
from keras_sparse.table import ShardedHashTable
from keras_sparse.table.keys import hash_keys
from keras_sparse.table.keys import seed_word

pytestmark = pytest.mark.backend_independent


def _sketch_estimates(keys, counts, query, width=1024, depth=4, seed=0):
    """Estimates of a count-min sketch (the former admission counter) fed
    ``counts`` of ``keys``, for ``query``."""
    shift = np.uint64(64 - (width.bit_length() - 1))
    est = None
    for r in range(depth):
        salt = seed_word(seed * 1000003 + 7919 * (r + 1))
        cells = np.zeros(width, np.int64)
        np.add.at(cells, (hash_keys(keys, salt, np) >> shift).astype(np.int64), counts)
        got = cells[(hash_keys(query, salt, np) >> shift).astype(np.int64)]
        est = got if est is None else np.minimum(est, got)
    return est


def _stream(rng, admit_after):
    """Batches of keys: 500 distinct keys seen 1 to admit_after + 1 times,
    shuffled and split at random (duplicates within a batch too)."""
    keys = rng.choice(2**40, size=500, replace=False).astype(np.int64)
    times = rng.integers(1, admit_after + 2, size=500)
    times[:300] = 1  # crowd the sketch with once-seen keys
    flat = rng.permutation(np.repeat(keys, times))
    cuts = np.sort(rng.choice(np.arange(1, flat.size), size=40, replace=False))
    return keys, times, np.split(flat, cuts)


def _check_against_dict(table, batches, admit_after):
    seen = {}
    for batch in batches:
        rows = table.lookup_or_insert(batch).rows
        for k in batch.tolist():
            seen[k] = seen.get(k, 0) + 1
        want = np.array([seen[k] >= admit_after for k in batch.tolist()])
        np.testing.assert_array_equal(np.asarray(rows) >= 0, want)
    keys = np.array(sorted(seen), np.int64)
    admitted = np.array([seen[k] >= admit_after for k in keys.tolist()])
    np.testing.assert_array_equal(np.asarray(table.lookup(keys)) >= 0, admitted)
    return seen


@pytest.mark.parametrize("admit_after", [2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_admitted_exactly_at_the_admit_after_th_sighting(admit_after, seed):
    rng = np.random.default_rng(seed)
    keys, times, batches = _stream(rng, admit_after)
    table = HashTable(1024, eviction="lru", admit_after=admit_after, device="cpu")
    seen = _check_against_dict(table, batches, admit_after)
    assert table.stats()["evictions"] == 0
    # Pending counts are the dict's counts of the keys not admitted.
    pending = {k: c for k, c in seen.items() if c < admit_after}
    got_keys, got_counts = table._impl.admission.state()
    assert dict(zip(got_keys.tolist(), got_counts.tolist())) == pending
    if admit_after == 2:
        # The former sketch would have admitted some once-seen keys.
        early = _sketch_estimates(keys, times, keys[times == 1]) >= 2
        assert early.any()


def test_sharded_table_admits_the_same_keys_as_one_table():
    rng = np.random.default_rng(5)
    keys, times, batches = _stream(rng, 2)
    one = HashTable(1024, admit_after=2, device="cpu")
    eight = ShardedHashTable(1024, num_shards=8, admit_after=2, device="cpu")
    for batch in batches:
        a = np.asarray(one.lookup_or_insert(batch).rows) >= 0
        b = np.asarray(eight.lookup_or_insert(batch).rows) >= 0
        np.testing.assert_array_equal(a, b)
    assert eight.size == one.size == int((times >= 2).sum())


def test_pending_keys_beyond_the_cap_forget_the_least_counted():
    table = HashTable(64, bucket_size=4, admit_after=3, device="cpu")
    pending = table._impl.admission
    assert pending.capacity == 64
    hot = np.arange(16, dtype=np.int64)
    table.lookup_or_insert(np.repeat(hot, 2))  # 2 sightings each
    for start in range(100, 500, 8):  # 400 once-seen keys pass by
        table.lookup_or_insert(np.arange(start, start + 8))
    assert len(pending) == 64
    # The twice-seen keys outlive the once-seen ones: one more sighting admits.
    rows = table.lookup_or_insert(hot).rows
    assert (rows >= 0).all()


def test_state_round_trip_and_load_keeps_the_most_counted():
    src = HashTable(256, admit_after=4, device="cpu")
    src.lookup_or_insert(np.repeat(np.arange(10), np.arange(1, 11) % 4))
    keys, counts = src._impl.admission.state()
    assert dict(zip(keys.tolist(), counts.tolist())) == {
        k: (k + 1) % 4 for k in range(10) if (k + 1) % 4
    }
    small = HashTable(16, bucket_size=4, admit_after=4, device="cpu")
    pending = small._impl.admission
    many = np.arange(1000, 1040, dtype=np.int64)
    kept = pending.load_state(many, np.arange(40) % 3 + 1)
    assert kept <= 16 and len(pending) == kept
    assert set(pending.state()[1].tolist()) <= {3, 2}  # most counted first
    dst = HashTable(256, admit_after=4, device="cpu")
    assert dst._impl.admission.load_state(keys, counts) == len(keys)
    for a, b in zip(dst._impl.admission.state(), (keys, counts)):
        np.testing.assert_array_equal(a, b)
    # Continuing from the loaded counts admits like the source.
    more = np.arange(10)
    np.testing.assert_array_equal(
        src.lookup_or_insert(more).rows >= 0, dst.lookup_or_insert(more).rows >= 0
    )
