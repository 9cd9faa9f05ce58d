"""Time to live of hash tables (``ttl_steps``), conformance suite.

Every table test takes the ``device`` fixture; tests/gpu/test_hash_ttl_gpu.py
re-imports them with ``device="gpu"`` (real or emulated CUDA). References: a
dict model of the keys' last-seen steps, and a table without a time to live
whose expired keys the test erases itself before each call (same eviction
semantics, so exact under eviction too).
"""

import numpy as np
import pytest

from keras_sparse.table import BatchTooLargeError
from keras_sparse.table import HashTable
from keras_sparse.table import ShardedHashTable
from keras_sparse.table import TableFullError

pytestmark = pytest.mark.backend_independent  # tables only: the JAX run


@pytest.fixture(params=["cpu"])
def device(request):
    return request.param


def host(x):
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else x


def live(t):
    keys, rows, _ = (np.asarray(host(a)) for a in t.export())
    return dict(zip(keys.tolist(), rows.tolist()))


def test_ttl_steps_validated(device):
    for bad in (0, -1, 2.5, "3", True):
        with pytest.raises(ValueError, match="ttl_steps"):
            HashTable(64, device=device, ttl_steps=bad)
    assert HashTable(64, device=device, ttl_steps=3).ttl_steps == 3
    assert HashTable(64, device=device).ttl_steps is None
    assert HashTable(64, device=device).stats()["expired"] == 0


@pytest.mark.parametrize(
    "eviction,admit_after", [("lru", 1), ("lfu", 2), (None, 1), ("lru", 2)]
)
def test_ttl_matches_dict_model(device, eviction, admit_after):
    """Roomy table (no evictions): a key seen at step t lives through step
    t + N and is gone from t + N + 1; lookups do not refresh it; an expired
    key coming back is a new key (fresh row); the expired counter counts."""
    n_steps, rng = 3, np.random.default_rng(len(str(eviction)) + admit_after)
    t = HashTable(
        4096,
        device=device,
        eviction=eviction,
        admit_after=admit_after,
        ttl_steps=n_steps,
    )
    seen, rows, sightings, expired = {}, {}, {}, 0
    for step in range(1, 60):
        if rng.random() < 0.2:  # inference: no refresh, nothing inserted
            batch = rng.integers(0, 40, 10)
            got = np.asarray(host(t.lookup(batch, count=False))).tolist()
            assert got == [rows.get(k, -1) for k in batch.tolist()]
        # Expiry at the start of the training call of `step`.
        for k in [k for k, s in seen.items() if s < step - n_steps]:
            del seen[k], rows[k]
            expired += 1
        batch = rng.integers(0, 40, int(rng.integers(1, 12)))
        res, fresh = t.lookup_or_insert_fresh(batch)
        got, fresh = np.asarray(host(res.rows)), np.asarray(host(fresh))
        # Admission counts a call's duplicates: all positions of a key
        # admitted in the call get its (fresh) row.
        keys, counts = np.unique(batch, return_counts=True)
        new = {}
        for k, c in zip(keys.tolist(), counts.tolist()):
            if k not in rows:
                sightings[k] = sightings.get(k, 0) + c
                if sightings[k] >= admit_after:
                    new[k] = int(got[batch.tolist().index(k)])
                    del sightings[k]
        for i, k in enumerate(batch.tolist()):
            assert got[i] == rows.get(k, new.get(k, -1))
            assert fresh[i] == (k in new)
        rows.update(new)
        assert len(set(new.values())) == len(new) and min(new.values(), default=0) >= 0
        for k in set(batch.tolist()) & set(rows):
            seen[k] = step
        assert live(t) == rows
        assert t.stats()["expired"] == expired
    assert expired > 10


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_ttl_under_eviction_equals_erasing_first(device, eviction):
    """A full table evicting and expiring: rows, fresh flags, evictions and
    stored state equal those of a table without TTL whose expired keys are
    erased before each call."""
    n_steps, rng = 2, np.random.default_rng(7)
    t = HashTable(64, bucket_size=4, device=device, eviction=eviction, ttl_steps=2)
    ref = HashTable(64, bucket_size=4, device=device, eviction=eviction)
    seen, expired = {}, 0
    for step in range(1, 30):
        gone = [k for k, s in seen.items() if s < step - n_steps]
        for k in gone:
            del seen[k]
        expired += ref.erase(np.array(gone, np.int64)) if gone else 0
        batch = rng.zipf(1.3, 40).astype(np.int64) % 500
        a, fa = t.lookup_or_insert_fresh(batch)
        b, fb = ref.lookup_or_insert_fresh(batch)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(host(x), host(y))
        np.testing.assert_array_equal(host(fa), host(fb))
        for k in host(b.evicted_keys).tolist():
            seen.pop(k, None)
        for k, r in zip(batch.tolist(), np.asarray(host(b.rows)).tolist()):
            if r >= 0:
                seen[k] = step
        for x, y in zip(t.export(), ref.export()):
            np.testing.assert_array_equal(host(x), host(y))
    stats = t.stats()
    assert stats["expired"] == expired > 0 and stats["evictions"] > 0


def same_pair_keys(t, count):
    """Keys sharing both candidate buckets (two buckets hold all of them)."""
    cand = np.arange(200_000, dtype=np.int64)
    b1, b2 = (np.asarray(host(a)) for a in t.candidate_buckets(cand))
    pair = np.minimum(b1, b2) * t.num_buckets + np.maximum(b1, b2)
    vals, counts = np.unique(pair, return_counts=True)
    return cand[pair == vals[np.argmax(counts)]][:count]


def test_expired_rows_serve_the_same_call(device):
    """eviction=None and full buckets: the call that expires keys places
    its new keys in their rows (else it would raise TableFullError)."""
    t = HashTable(64, bucket_size=4, device=device, eviction=None, ttl_steps=1)
    keys = same_pair_keys(t, 17)
    old, new = keys[:8], keys[8:16]
    rows = np.asarray(host(t.lookup_or_insert(old, step=1).rows))
    with pytest.raises(TableFullError):
        t.lookup_or_insert(keys[16:], step=2)  # nothing expired yet
    res = t.lookup_or_insert(new, step=3)  # `old` expires first
    assert sorted(np.asarray(host(res.new_rows)).tolist()) == sorted(rows.tolist())
    assert sorted(live(t)) == sorted(new.tolist())
    assert t.stats()["expired"] == 8


def test_refused_call_keeps_expired_keys(device):
    """A call that raises changes nothing: the keys it expired come back."""
    t = HashTable(64, device=device, eviction=None, ttl_steps=1)
    t.lookup_or_insert(np.arange(10), step=1)
    t.lookup_or_insert(np.arange(10, 12), step=2)
    before = [np.asarray(host(x)).tolist() for x in t.export()]
    with pytest.raises(BatchTooLargeError):  # expires 0..9, then raises
        t.lookup_or_insert(np.arange(1000, 1100), step=3)
    assert [np.asarray(host(x)).tolist() for x in t.export()] == before
    assert t.stats()["expired"] == 0
    t.lookup_or_insert(np.arange(10, 12), step=3)  # the keys 0..9 expire now
    assert sorted(live(t)) == [10, 11] and t.stats()["expired"] == 10


def test_explicit_steps_and_erase_import(device):
    """Expiry follows the ``step`` argument; erased keys leave no mark; an
    imported key counts as seen at the clock."""
    t = HashTable(256, device=device, ttl_steps=5)
    t.lookup_or_insert([1, 2], step=10)
    t.erase([2])
    t.import_([3], scores=[1])  # seen at the clock (10)
    t.lookup_or_insert([4], step=15)
    assert sorted(live(t)) == [1, 3, 4]
    t.lookup_or_insert([5], step=16)  # 1 and 3 (seen 10 < 16 - 5) expire
    assert sorted(live(t)) == [4, 5] and t.stats()["expired"] == 2


def test_undo_records_give_back_expired_keys(device):
    """`state_before` of calls that expired keys shows them; `restore`
    brings them back with their last-seen steps, so the table then
    expires (and maps) exactly as the one that never made those calls."""
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, 300, 30) for _ in range(30)]
    a = HashTable(128, bucket_size=4, device=device, eviction="lfu", ttl_steps=2)
    b = HashTable(128, bucket_size=4, device=device, eviction="lfu", ttl_steps=2)
    for batch in batches[:10]:
        a.lookup_or_insert(batch)
        b.lookup_or_insert(batch)
    log = []
    for batch in batches[10:15]:  # a maps ahead, recording
        a.lookup_or_insert_fresh(batch, undo=log)
    assert a.stats()["expired"] > b.stats()["expired"]
    state = a.state_before(log)
    for x, y in zip(state[:3], b.export()):
        np.testing.assert_array_equal(host(x), host(y))
    a.restore(state)
    for batch in batches[10:]:
        ra, rb = a.lookup_or_insert(batch), b.lookup_or_insert(batch)
        for x, y in zip(ra, rb):
            np.testing.assert_array_equal(host(x), host(y))
    for x, y in zip(a.export(), b.export()):
        np.testing.assert_array_equal(host(x), host(y))


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_sharded_expiry_matches_one_shard(eviction):
    """Key-sharded over 8 shards, keys expire at the same steps as on one
    (roomy shards: no evictions), counted over the shards."""
    rng = np.random.default_rng(11)
    one = ShardedHashTable(8192, 1, eviction=eviction, ttl_steps=3)
    eight = ShardedHashTable(8192, 8, eviction=eviction, ttl_steps=3)
    assert eight.ttl_steps == 3
    for _ in range(40):
        batch = rng.integers(0, 200, 25)
        a, b = one.lookup_or_insert(batch), eight.lookup_or_insert(batch)
        assert ((host(a.rows) >= 0) == (host(b.rows) >= 0)).all()
        assert sorted(live(one)) == sorted(live(eight))
    assert one.stats()["expired"] == eight.stats()["expired"] > 20
