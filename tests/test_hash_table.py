"""Conformance suite for keras_sparse.table.HashTable.

Every test takes the ``device`` fixture; tests/gpu/test_hash_table_gpu.py
re-imports these functions with ``device="gpu"``.  Exact results are checked
against a dict model where it can predict them (no eviction), invariants and
policy properties elsewhere.
"""

import threading

import numpy as np
import pytest

from keras_sparse.table import HashTable
from keras_sparse.table import TableFullError
from keras_sparse.table import hash_strings

I64 = np.iinfo(np.int64)
SPECIAL = [0, -1, 1, I64.min, I64.max, I64.min + 1, I64.max - 1]


@pytest.fixture(params=["cpu"])
def device(request):
    return request.param


def host(x):
    return (
        x.get()
        if hasattr(x, "get") and not isinstance(x, np.ndarray)
        else np.asarray(x)
    )


def make(device, capacity, **kw):
    return HashTable(capacity, device=device, **kw)


def check_invariants(t):
    keys, rows, scores = (host(a) for a in t.export())
    assert len(keys) == len(rows) == len(scores) == t.size
    assert len(np.unique(rows)) == len(rows), "two live keys share a row"
    assert len(np.unique(keys)) == len(keys), "a key is live twice"
    assert ((rows >= 0) & (rows < t.capacity)).all()
    np.testing.assert_array_equal(host(t.lookup(keys)), rows)
    return dict(zip(keys.tolist(), rows.tolist()))


def same_pair_keys(t, count, start=0):
    """Keys whose two candidate buckets are identical (forces collisions)."""
    cand = np.arange(start, start + 200_000, dtype=np.int64)
    b1, b2 = (host(a) for a in t.candidate_buckets(cand))
    pair = b1 * t.num_buckets + b2
    vals, counts = np.unique(pair, return_counts=True)
    best = vals[np.argmax(counts)]
    sel = cand[pair == best]
    assert len(sel) >= count
    return sel[:count]


# ------------------------------------------------------------------ validation
def test_validation(device):
    for bad in (0, -3, 2.5, "8", True):
        with pytest.raises(ValueError):
            make(device, bad)
    for bad in (0, 3, 12, -4, 2.0):
        with pytest.raises(ValueError):
            make(device, 64, bucket_size=bad)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError):
            make(device, 64, admit_after=bad)
    with pytest.raises(ValueError):
        make(device, 64, eviction="fifo")
    t = make(device, 64)
    with pytest.raises(TypeError, match="keys"):
        t.lookup(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="keys"):
        t.lookup_or_insert(np.array([True]))


def test_capacity_rounding_and_properties(device):
    t = make(device, 100, bucket_size=8, eviction="lfu", admit_after=2, seed=3)
    assert t.capacity == 104 and t.capacity % t.bucket_size == 0
    assert make(device, 1, bucket_size=4).capacity == 16  # at least 4 buckets
    assert (t.bucket_size, t.eviction, t.admit_after, t.device) == (8, "lfu", 2, device)
    assert t.size == 0 and t.load_factor == 0.0
    s = t.stats()
    for name in (
        "hits",
        "misses",
        "inserts",
        "evictions",
        "rejected_admissions",
        "size",
        "capacity",
        "load_factor",
    ):
        assert name in s


# --------------------------------------------------------------- basic behaviour
def test_special_keys_and_shapes(device):
    t = make(device, 256)
    sentinels = list(t._impl._sentinels[:2])
    keys = np.array(SPECIAL + sentinels, dtype=np.int64)
    assert (host(t.lookup(keys)) == -1).all()
    res = t.lookup_or_insert(keys.reshape(3, 3))
    rows = host(res.rows)
    assert rows.shape == (3, 3) and (rows >= 0).all()
    assert len(np.unique(rows)) == 9
    np.testing.assert_array_equal(host(t.lookup(keys)), rows.ravel())
    np.testing.assert_array_equal(np.sort(host(res.new_rows)), np.sort(rows.ravel()))
    check_invariants(t)
    # uint64 keys are the same bit patterns
    u = keys.view(np.uint64)
    np.testing.assert_array_equal(host(t.lookup(u)), rows.ravel())


def test_duplicates_and_empty(device):
    t = make(device, 64)
    res = t.lookup_or_insert(np.full(1000, 42, np.int64))
    rows = host(res.rows)
    assert (rows == rows[0]).all() and rows[0] >= 0
    assert host(res.new_rows).tolist() == [rows[0]]
    assert t.size == 1
    e = t.lookup_or_insert(np.zeros((0, 3), np.int64))
    assert host(e.rows).shape == (0, 3) and len(host(e.new_rows)) == 0
    assert host(t.lookup([])).shape == (0,)
    assert t.erase([]) == 0


def test_input_types(device):
    t = make(device, 128)
    ref = host(t.lookup_or_insert(np.arange(12, dtype=np.int64).reshape(3, 4)).rows)
    variants = [
        np.arange(12, dtype=np.int32).reshape(3, 4),
        np.arange(12, dtype=np.uint64).reshape(3, 4),
        np.arange(12).reshape(3, 4).tolist(),
    ]
    try:
        import torch

        variants.append(torch.arange(12).reshape(3, 4))
    except ImportError:
        pass
    try:
        import tensorflow as tf

        variants.append(tf.reshape(tf.range(12, dtype=tf.int64), (3, 4)))
    except ImportError:
        pass
    try:
        import jax.numpy as jnp

        variants.append(jnp.arange(12, dtype=jnp.int32).reshape(3, 4))
    except ImportError:
        pass
    for v in variants:
        np.testing.assert_array_equal(host(t.lookup(v)), ref)
        np.testing.assert_array_equal(host(t.lookup_or_insert(v).rows), ref)
    assert host(t.lookup(5)).shape == ()
    assert int(host(t.lookup(5))) == ref.ravel()[5]


# ------------------------------------------------------------- model comparison
@pytest.mark.parametrize("bucket_size", [1, 4, 16])
@pytest.mark.parametrize("eviction", ["lru", "lfu", None])
def test_random_ops_match_dict_model(device, bucket_size, eviction):
    """No-eviction regime: few keys vs capacity, so the model is exact."""
    rng = np.random.default_rng(bucket_size * 7 + len(str(eviction)))
    t = make(device, 4096, bucket_size=bucket_size, eviction=eviction, seed=bucket_size)
    n_univ = (
        600 if bucket_size > 1 else 40
    )  # keep both-buckets-full impossible in practice
    universe = np.concatenate(
        [
            np.array(SPECIAL, np.int64),
            rng.integers(I64.min, I64.max, n_univ, dtype=np.int64),
        ]
    )
    model = {}
    for _ in range(120):
        batch = rng.choice(universe, size=int(rng.integers(0, 200)))
        kind = rng.random()
        if kind < 0.45:
            res = t.lookup_or_insert(batch)
            rows = host(res.rows)
            new = set(host(res.new_rows).tolist())
            assert len(host(res.evicted_keys)) == 0
            fresh = set(batch.tolist()) - set(model)
            for k, r in zip(batch.tolist(), rows.tolist()):
                if k in model:
                    assert r == model[k]
                else:
                    assert r in new
                    model[k] = r
            assert new == {model[k] for k in fresh}
        elif kind < 0.7:
            rows = host(t.lookup(batch))
            assert rows.tolist() == [model.get(k, -1) for k in batch.tolist()]
        elif kind < 0.85:
            n = t.erase(batch)
            gone = set(batch.tolist()) & set(model)
            assert n == len(gone)
            for k in gone:
                del model[k]
        elif kind < 0.95:
            keys, rows, scores = t.export()
            t2 = make(
                device,
                4096,
                bucket_size=bucket_size,
                eviction=eviction,
                seed=bucket_size,
            )
            t2.import_(keys, rows, scores)
            assert check_invariants(t2) == model
            t = t2
        else:
            t.clear()
            model.clear()
        assert check_invariants(t) == model


# ------------------------------------------------------------------- eviction
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_eviction_regime_invariants(device, eviction):
    rng = np.random.default_rng(5)
    t = make(device, 256, bucket_size=8, eviction=eviction)
    for step in range(60):
        batch = rng.integers(0, 3000, size=int(rng.integers(1, 120)))
        before = check_invariants(t)
        res = t.lookup_or_insert(batch, step=step + 1)
        after = check_invariants(t)
        rows, ek, er = host(res.rows), host(res.evicted_keys), host(res.evicted_rows)
        live = rows >= 0
        # every occurrence of a key gets its current row; evicted keys are gone
        for k, r in zip(batch[live].tolist(), rows[live].tolist()):
            assert after[k] == r
        for k, r in zip(ek.tolist(), er.tolist()):
            assert before[k] == r and k not in after
            assert k not in set(batch.tolist())
        assert set(host(res.new_rows).tolist()) == {
            after[k] for k in set(batch[live].tolist()) - set(before)
        }


def _fill_pair(device, eviction, S=2):
    t = make(device, 16, bucket_size=S, eviction=eviction)
    keys = same_pair_keys(t, 2 * S + 3)
    for i, k in enumerate(keys[: 2 * S]):
        res = t.lookup_or_insert([k], step=10 + i)
        assert int(host(res.rows)[0]) >= 0
    return t, keys


def test_lru_victim_is_oldest(device):
    t, keys = _fill_pair(device, "lru")
    t.lookup_or_insert([keys[0]], step=100)  # refresh the oldest
    t.lookup(keys[1:4])  # lookups must not refresh
    res = t.lookup_or_insert([keys[4]], step=101)
    assert host(res.evicted_keys).tolist() == [keys[1]]
    res = t.lookup_or_insert([keys[5]], step=102)
    assert host(res.evicted_keys).tolist() == [keys[2]]
    check_invariants(t)


def test_lfu_victim_is_least_frequent(device):
    t, keys = _fill_pair(device, "lfu")
    t.lookup_or_insert([keys[0], keys[0], keys[1], keys[3], keys[3]])
    t.lookup_or_insert([keys[1], keys[3]])
    # counts: k0=3, k1=3, k2=1, k3=4 -> k2 goes
    res = t.lookup_or_insert([keys[4]])
    assert host(res.evicted_keys).tolist() == [keys[2]]
    ek, er = host(res.evicted_keys), host(res.evicted_rows)
    assert host(res.new_rows).tolist() == er.tolist()
    scores = dict(zip(host(t.export()[0]).tolist(), host(t.export()[2]).tolist()))
    assert scores[keys[4]] == 1 and scores[keys[3]] == 4 and ek[0] not in scores


def test_same_call_keys_not_evicted(device):
    t, keys = _fill_pair(device, "lru")
    res = t.lookup_or_insert(keys[: 2 * S_PAIR + 2])  # 4 hits + 2 new in a full pair
    rows = host(res.rows)
    assert (rows[: 2 * S_PAIR] >= 0).all() and (rows[2 * S_PAIR :] == -1).all()
    assert len(host(res.evicted_keys)) == 0
    assert t.stats()["overflows"] == 2
    check_invariants(t)


S_PAIR = 2


def test_eviction_none_leaves_table_unchanged(device):
    t, keys = _fill_pair(device, None)
    snap = [host(a) for a in t.export()]
    stats = t.stats()
    with pytest.raises(TableFullError, match="capacity"):
        t.lookup_or_insert([keys[0], keys[5], 123456789])
    for a, b in zip(snap, (host(a) for a in t.export())):
        np.testing.assert_array_equal(a, b)
    assert t.stats() == stats
    assert issubclass(TableFullError, RuntimeError)


def test_table_works_on_after_a_refused_call(device):
    """A refused call (both buckets of a key full, eviction=None) changes
    nothing, and the calls after it run as on a table that never saw it."""
    t, keys = _fill_pair(device, None)
    other = make(device, 16, bucket_size=S_PAIR, eviction=None)
    for k in keys[: 2 * S_PAIR]:
        other.lookup_or_insert([k])
    with pytest.raises(TableFullError):
        t.lookup_or_insert([keys[0], keys[5]])
    later = [keys[1], 77, 78, 77]
    a, b = t.lookup_or_insert(later), other.lookup_or_insert(later)
    np.testing.assert_array_equal(host(a.rows), host(b.rows))
    np.testing.assert_array_equal(host(a.new_rows), host(b.new_rows))
    assert t.stats() == other.stats() and t.size == 2 * S_PAIR + 2
    check_invariants(t)


def test_batch_larger_than_capacity(device):
    t = make(device, 64, bucket_size=4, eviction="lru")
    t.lookup_or_insert(np.arange(10))
    snap = [host(a) for a in t.export()]
    with pytest.raises(ValueError, match="capacity"):
        t.lookup_or_insert(np.arange(1000, 1100))
    for a, b in zip(snap, (host(a) for a in t.export())):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------- admission
def test_admission(device):
    t = make(device, 256, admit_after=3)
    assert int(host(t.lookup_or_insert([7]).rows)[0]) == -1
    assert int(host(t.lookup_or_insert([7]).rows)[0]) == -1
    assert t.stats()["rejected_admissions"] == 2 and t.size == 0
    r = host(t.lookup_or_insert([7, 8]).rows)
    assert r[0] >= 0 and r[1] == -1
    # duplicates inside one call count: 3 occurrences admit at once; the
    # counters take them one at a time (2 rejected, then the insert)
    r = host(t.lookup_or_insert([9, 9, 9]).rows)
    assert (r == r[0]).all() and r[0] >= 0
    assert t.stats()["rejected_admissions"] == 5
    assert int(host(t.lookup([8]))[0]) == -1
    with pytest.raises(ValueError):
        make(device, 64, admit_after=0)


def test_admission_undone_on_error(device):
    t = make(device, 16, bucket_size=4, eviction=None, admit_after=2)
    t.lookup_or_insert(np.arange(100, 116))
    t.lookup_or_insert(np.arange(100, 114))  # admitted, 14 live
    keys, counts = t._impl.admission.state()
    assert 114 in keys.tolist() and set(counts.tolist()) == {1}
    with pytest.raises(TableFullError):
        t.lookup_or_insert(np.arange(100, 116))
    for a, b in zip(t._impl.admission.state(), (keys, counts)):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------- export/import
def test_export_import_roundtrip_and_conflicts(device):
    t = make(device, 512, eviction="lfu", seed=9)
    keys = np.array(SPECIAL + list(range(100, 300)), np.int64)
    t.lookup_or_insert(keys)
    t.lookup_or_insert(keys[:50])
    k, r, s = (host(a) for a in t.export())
    t2 = make(device, 512, eviction="lfu", seed=9)
    t2.import_(k, r, s)
    for a, b in zip((k, r, s), (host(a) for a in t2.export())):
        np.testing.assert_array_equal(a, b)
    t2.import_(k[:5], r[:5], s[:5])  # idempotent for identical entries
    with pytest.raises(ValueError):
        t2.import_([999999], [int(r[0])])  # row taken by another key
    with pytest.raises(ValueError):
        t2.import_([int(k[0])], [int(r[1])])  # key live elsewhere / wrong bucket
    with pytest.raises(ValueError):
        t2.import_([1, 2], [t2.capacity, 0])
    with pytest.raises(ValueError):
        t2.import_([1, 2], [3, 3])
    t3 = make(device, 1024, eviction="lfu", seed=9)
    with pytest.raises(ValueError, match="bucket"):
        t3.import_(k, r)
    t4 = make(device, 512, eviction="lfu")
    t4.import_(k)  # rows=None assigns rows
    assert set(check_invariants(t4)) == set(k.tolist())


def test_erase_and_clear(device):
    t = make(device, 128)
    rows = host(t.lookup_or_insert([1, 2, 3]).rows)
    assert t.erase([2, 2, 5]) == 1
    assert host(t.lookup([1, 2, 3])).tolist() == [rows[0], -1, rows[2]]
    t.clear()
    assert t.size == 0 and (host(t.lookup([1, 3])) == -1).all()
    check_invariants(t)


def test_threads(device):
    t = make(device, 8192, eviction=None)
    errors = []

    def worker(i):
        try:
            for j in range(20):
                t.lookup_or_insert(
                    np.arange(i * 10000 + j * 50, i * 10000 + j * 50 + 50)
                )
        except Exception as e:  # pragma: no cover - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert t.size == 4000
    assert len(check_invariants(t)) == 4000


def test_lookup_does_not_touch_scores(device):
    t = make(device, 64, eviction="lfu")
    t.lookup_or_insert([1, 2])
    before = host(t.export()[2]).copy()
    t.lookup([1, 1, 2])
    np.testing.assert_array_equal(host(t.export()[2]), before)


# ------------------------------------------------------------------ key hashing
def test_hash_strings_stable():
    h = hash_strings(["", "a", "foobar", "héllo"])
    assert h.dtype == np.int64
    expected = [0xCBF29CE484222325, 0xAF63DC4C8601EC8C, 0x85944171F73967E8]
    assert h[:3].view(np.uint64).tolist() == expected
    assert hash_strings(np.array([["a", "b"]])).shape == (1, 2)
    assert hash_strings([b"foobar"])[0] == h[2]


# --------------------------------------------------------------------------
# CPU emulations of the CUDA kernels in keras_sparse/kernels/hash_table.cu (they
# cannot run here): each mirrors its kernel thread by thread and must agree with the
# NumPy twin, which the GPU conformance run then checks on real hardware.


def _emulate_ks_find(impl, keys):
    """ks_find: 16-lane tiles, uint4 digest load when S % 16 == 0, ballot."""
    from keras_sparse.table.keys import bucket_pair
    from keras_sparse.table.keys import hash_keys

    S, tile = impl.bucket_size, 16
    h = hash_keys(np.asarray(keys, np.int64), impl.salt)
    b1, b2 = bucket_pair(h.copy(), impl.num_buckets)
    dig, tkeys = host(impl.digest), host(impl.keys)
    out = []
    for i, k in enumerate(np.asarray(keys, np.int64).tolist()):
        d = int(h[i]) & 0xFF
        found = -1
        for base in (int(b1[i]) * S, int(b2[i]) * S):
            for off in range(0, S, tile):
                bal = 0
                if S % tile == 0:  # one 16-byte load, byte j of the uint4
                    words = dig[base + off : base + off + 16].view("<u4").tolist()
                for lane in range(tile):
                    j = off + lane
                    if j >= S:
                        continue
                    if S % tile == 0:
                        w = words[lane // 4]
                        dj = (w >> (8 * (lane & 3))) & 0xFF
                    else:
                        dj = int(dig[base + j])
                    if dj == d and int(tkeys[base + j]) == k:
                        bal |= 1 << lane
                if found < 0 and bal:
                    found = base + off + ((bal & -bal).bit_length() - 1)
        out.append(found)
    return np.asarray(out, np.int64)


@pytest.mark.parametrize("bucket_size", [4, 8, 16, 32])
def test_find_kernel_emulation(bucket_size):
    rng = np.random.default_rng(bucket_size)
    t = HashTable(1024, bucket_size=bucket_size, eviction="lru", device="cpu")
    live = rng.integers(I64.min, I64.max, 700, dtype=np.int64)
    t.lookup_or_insert(live)
    t.erase(live[:50])
    probe = np.concatenate([live, rng.integers(I64.min, I64.max, 300), SPECIAL])
    want = t._impl.find(probe)
    np.testing.assert_array_equal(_emulate_ks_find(t._impl, probe), want)
    assert (want >= 0).sum() > 500


def _emulate_ks_claim_compact(impl, a, choose, ak, d, new_score):
    """ks_claim_compact thread by thread (load read-only during the launch)."""
    S, n = impl.bucket_size, len(choose)
    sh = max(n - 1, 1).bit_length()
    comp = np.sort((choose << sh) | np.arange(n, dtype=np.int64))
    slots = np.empty(n, np.int64)
    ok = np.empty(n, bool)
    load = impl.load.copy()
    writes = []
    for i in range(n):
        c = int(comp[i])
        bkt, arrival = c >> sh, c & ((1 << sh) - 1)
        free = S - int(load[bkt])
        rank = 0
        while (
            rank < free and i - rank - 1 >= 0 and int(comp[i - rank - 1]) >> sh == bkt
        ):
            rank += 1
        if rank < free:
            slot = bkt * S + int(load[bkt]) + rank
            u = int(a[arrival])
            writes.append((slot, ak[u], d[u], new_score[u]))
            slots[arrival], ok[arrival] = slot, True
        else:
            slots[arrival], ok[arrival] = -1, False
    for slot, k, dd, sc in writes:
        impl.keys[slot], impl.digest[slot], impl.score[slot] = k, dd, sc
    return slots, ok


@pytest.mark.parametrize("bucket_size", [2, 16])
def test_claim_kernel_emulation(bucket_size):
    import copy

    rng = np.random.default_rng(bucket_size + 1)
    t = HashTable(512, bucket_size=bucket_size, eviction="lru", device="cpu")
    t.lookup_or_insert(rng.integers(I64.min, I64.max, 300, dtype=np.int64))
    impl = t._impl
    assert not impl.holey.any()
    m = 400
    ak = rng.integers(I64.min, I64.max, m, dtype=np.int64)
    b1, b2, d = impl.hash(ak)
    new_score = rng.integers(0, 99, m)
    a = np.sort(rng.choice(m, 300, replace=False)).astype(np.int64)
    l1, l2 = impl.load[b1[a]], impl.load[b2[a]]
    roomy = np.minimum(l1, l2) < bucket_size
    choose = np.where(l1 <= l2, b1[a], b2[a])[roomy]
    a = a[roomy]
    ref = copy.deepcopy(impl)
    won, want_slots, lost = ref._claim_write(a, choose, ak, d, new_score)
    got_slots, got_ok = _emulate_ks_claim_compact(impl, a, choose, ak, d, new_score)
    # the CuPy wrapper returns (a[ok], slots[ok], a[~ok]) from the kernel
    np.testing.assert_array_equal(a[~got_ok], lost)
    by_key = np.argsort(won)
    np.testing.assert_array_equal(a[got_ok], won[by_key])
    np.testing.assert_array_equal(got_slots[got_ok], want_slots[by_key])
    assert len(won) > 0 and len(lost) > 0
    for name in ("keys", "digest", "score"):
        np.testing.assert_array_equal(getattr(impl, name), getattr(ref, name))


@pytest.mark.parametrize("bucket_size", [8, 16, 32])
def test_fast_find_matches_generic_probe(bucket_size):
    """NumpyTable.find (chunked, fused) == ArrayTable.find (generic probe)."""
    from keras_sparse.table.array_table import ArrayTable
    from keras_sparse.table.numpy_table import NumpyTable

    rng = np.random.default_rng(bucket_size)
    t = HashTable(1 << 12, bucket_size=bucket_size, eviction="lru", device="cpu")
    live = rng.integers(I64.min, I64.max, 3500, dtype=np.int64)
    t.lookup_or_insert(live)
    t.erase(live[::7])
    impl = t._impl
    assert type(impl) is NumpyTable
    probe = np.concatenate(
        [live, rng.integers(I64.min, I64.max, 3000), SPECIAL, impl.bucket_sentinel]
    )
    np.testing.assert_array_equal(impl.find(probe), ArrayTable.find(impl, probe))
    b1, b2, d = impl.hash(probe)
    r1, r2, rd = ArrayTable.hash(impl, probe)
    np.testing.assert_array_equal(b1, r1)
    np.testing.assert_array_equal(b2, r2)
    np.testing.assert_array_equal(d, rd)


@pytest.mark.parametrize("bucket_size", [2, 16])
def test_fast_claim_matches_generic(bucket_size):
    """NumpyTable._claim_write (compact fast path) == ArrayTable._claim_write."""
    import copy

    from keras_sparse.table.array_table import ArrayTable

    rng = np.random.default_rng(bucket_size + 7)
    t = HashTable(1024, bucket_size=bucket_size, eviction="lru", device="cpu")
    t.lookup_or_insert(rng.integers(I64.min, I64.max, 600, dtype=np.int64))
    impl = t._impl
    assert not impl.holey.any()
    m = 800
    ak = rng.integers(I64.min, I64.max, m, dtype=np.int64)
    b1, b2, d = impl.hash(ak)
    new_score = rng.integers(0, 99, m)
    for a in (np.arange(m), np.sort(rng.choice(m, 500, replace=False))):
        choose = np.where(impl.load[b1[a]] <= impl.load[b2[a]], b1[a], b2[a])
        ref = copy.deepcopy(impl)
        won, slots, lost = impl._claim_write(a, choose, ak, d, new_score)
        r_won, r_slots, r_lost = ArrayTable._claim_write(
            ref, a, choose, ak, d, new_score
        )
        assert len(lost) > 0 and len(won) > 0
        np.testing.assert_array_equal(lost, r_lost)
        pairs = np.sort(won * impl.capacity + slots)  # (key index, slot) pairs
        np.testing.assert_array_equal(pairs, np.sort(r_won * impl.capacity + r_slots))
        for name in ("keys", "digest", "score"):
            np.testing.assert_array_equal(getattr(impl, name), getattr(ref, name))
        impl.__dict__.update(copy.deepcopy(ref.__dict__))  # undo for the next a


def test_new_keys_placed_in_first_occurrence_order(device):
    """Dup-free and duplicate batches rank new keys by first occurrence."""
    keys = np.asarray([50, 7, 50, 3, 7, 9, 3], np.int64)
    a = HashTable(64, eviction="lru", device=device, seed=3)
    b = HashTable(64, eviction="lru", device=device, seed=3)
    rows = host(a.lookup_or_insert(keys).rows)
    uniq = np.asarray([50, 7, 3, 9], np.int64)  # first-occurrence order
    rows_u = host(b.lookup_or_insert(uniq).rows)
    want = dict(zip(uniq.tolist(), rows_u.tolist()))
    assert rows.tolist() == [want[k] for k in keys.tolist()]


@pytest.mark.parametrize("eviction,admit_after", [("lru", 1), ("lfu", 2)])
def test_fresh_flags_mark_keys_given_a_new_row(device, eviction, admit_after):
    """``lookup_or_insert_fresh`` flags exactly the positions whose row is one
    of the call's ``new_rows`` (duplicates, hits, evictions, admission),
    and the rows equal those of ``lookup_or_insert`` on a twin table."""
    rng = np.random.default_rng(7)
    a = make(device, 64, eviction=eviction, admit_after=admit_after, seed=1)
    b = make(device, 64, eviction=eviction, admit_after=admit_after, seed=1)
    seen_fresh = seen_hit = 0
    for _ in range(30):
        keys = rng.zipf(1.3, size=(6, 5)).astype(np.int64) % 300
        res, fresh = a.lookup_or_insert_fresh(keys)
        twin = b.lookup_or_insert(keys)
        rows, fresh = host(res.rows), host(fresh)
        np.testing.assert_array_equal(rows, host(twin.rows))
        np.testing.assert_array_equal(host(res.new_rows), host(twin.new_rows))
        assert fresh.shape == keys.shape and fresh.dtype == bool
        want = np.isin(rows, host(res.new_rows)) & (rows >= 0)
        np.testing.assert_array_equal(fresh, want)
        seen_fresh += int(fresh.sum())
        seen_hit += int(((rows >= 0) & ~fresh).sum())
    assert seen_fresh and seen_hit
    assert a.stats() == b.stats() and a.stats()["evictions"] > 0


def test_find_for_insert_matches_find():
    """The CPU split (hits, misses, their hashes) agrees with find + hash."""
    from keras_sparse.table.array_table import ArrayTable

    rng = np.random.default_rng(5)
    t = HashTable(1 << 12, eviction="lru", device="cpu")
    live = rng.integers(I64.min, I64.max, 3000, dtype=np.int64)
    t.lookup_or_insert(live)
    impl = t._impl
    probe = np.concatenate([live[::2], rng.integers(I64.min, I64.max, 1 << 16)])
    rng.shuffle(probe)
    rows, hit_rows, miss_idx, hashes = impl._find_for_insert(probe)
    r_rows, r_hit, r_miss, r_hashes = ArrayTable._find_for_insert(impl, probe)
    assert r_hashes is None
    np.testing.assert_array_equal(rows, r_rows)
    np.testing.assert_array_equal(hit_rows, r_hit)
    np.testing.assert_array_equal(miss_idx, r_miss)
    for got, want in zip(hashes, impl.hash(probe[miss_idx])):
        np.testing.assert_array_equal(got, want)


def test_fast_choose_buckets_matches_generic():
    """NumpyTable._choose_buckets (chunked) == ArrayTable._choose_buckets."""
    from keras_sparse.table.array_table import ArrayTable
    from keras_sparse.table.numpy_table import _CHUNK

    rng = np.random.default_rng(11)
    t = HashTable(1 << 12, bucket_size=4, eviction="lru", device="cpu")
    t.lookup_or_insert(rng.integers(I64.min, I64.max, 3500, dtype=np.int64))
    impl = t._impl
    b1, b2, _ = impl.hash(rng.integers(I64.min, I64.max, 2 * _CHUNK + 5))
    got, want = impl._choose_buckets(b1, b2), ArrayTable._choose_buckets(impl, b1, b2)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert not want[1].all() and want[1].any()


def _generic_evict(t):
    """``t`` with ``ArrayTable._evict_round`` instead of the CPU twin's."""
    from keras_sparse.table.array_table import ArrayTable

    impl = t._impl
    impl._evict_round = lambda *args: ArrayTable._evict_round(impl, *args)
    return t


@pytest.mark.parametrize("bucket_size", [4, 16])
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("admit_after", [1, 2])
def test_fast_evict_round_matches_generic(bucket_size, eviction, admit_after):
    """NumpyTable._evict_round (per-bucket minima) == ArrayTable's, call by call.

    Covers both minima sources (whole score array for large batches, the
    keys' own buckets for small ones), both protection forms (score == step
    and the bool array used when a step does not advance the clock), holes
    from erase, and Zipf-like duplicates.
    """
    kw = dict(bucket_size=bucket_size, eviction=eviction, admit_after=admit_after)
    fast = HashTable(1 << 10, device="cpu", seed=4, **kw)
    slow = _generic_evict(HashTable(1 << 10, device="cpu", seed=4, **kw))
    sources = set()  # which minima source each round used
    minima = fast._impl._bucket_minima

    def spy(buckets, prot):
        sources.add(("all" if buckets is None else "own", isinstance(prot, int)))
        return minima(buckets, prot)

    fast._impl._bucket_minima = spy
    rng = np.random.default_rng(bucket_size + admit_after)
    for i in range(40):
        n = int(rng.choice([8, 60, 500, 900]))
        batch = (rng.pareto(0.8, n) * 50).astype(np.int64) % 20_000
        if n == 900:  # mostly new keys: rounds larger than the bucket count
            batch = rng.integers(0, 1 << 40, n // admit_after)
            batch = np.repeat(batch, admit_after)  # admitted in this call
        kwargs = {}  # the internal clock advances
        if i % 7 == 3:  # a step that does not advance the clock
            kwargs = dict(step=fast._impl.clock)
        elif i % 2:
            kwargs = dict(step=fast._impl.clock + 2)
        got, want = (
            fast.lookup_or_insert(batch, **kwargs),
            slow.lookup_or_insert(batch, **kwargs),
        )
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        if i % 9 == 5:
            gone = batch[: n // 3]
            assert fast.erase(gone) == slow.erase(gone)
    for g, w in zip(fast.export(), slow.export()):
        np.testing.assert_array_equal(g, w)
    assert fast.stats() == slow.stats()
    assert fast.stats()["evictions"] > 50
    assert {src for src, _ in sources} == {"all", "own"}
    assert {by_score for _, by_score in sources} == (
        {True, False} if eviction == "lru" else {False}
    )


@pytest.mark.parametrize("high", [False, True])
def test_first_claims_marks_earliest_claim(high):
    """One winner per contended slot: its first claimant (both code paths)."""
    from keras_sparse.table.numpy_table import NumpyTable

    victim = np.asarray([5, 3, 5, 9, 3, 3, 7], np.int64)
    if high:  # too large for (slot, position) words: the np.unique fallback
        victim = victim + (1 << 60)
    won = NumpyTable._first_claims(victim)
    assert won.tolist() == [True, True, False, True, False, False, True]


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("admit_after", [1, 2])
def test_state_before_gives_back_each_earlier_table(device, eviction, admit_after):
    # A prefetch stage maps batches ahead: a save must see the table before
    # them. Snapshots taken before each call are the reference.
    t = make(device, 64, eviction=eviction, admit_after=admit_after)
    rng = np.random.default_rng(3)
    log, snapshots = [], []

    def snapshot():
        keys, rows, scores = (host(a) for a in t.export())
        pending = getattr(t._impl, "admission", None)
        counts = None if pending is None else pending.state()
        return keys, rows, scores, t._impl.clock, counts

    for _ in range(12):
        snapshots.append(snapshot())
        batch = rng.integers(0, 200, 48)  # 200 keys into 64 rows: evictions
        t.lookup_or_insert_fresh(batch, undo=log)
    assert len(log) == 12 and t.stats()["evictions"] > 0
    if admit_after > 1:  # the 64 pending slots also forgot keys
        assert sum(int(r.admission.evicted_keys.shape[0]) for r in log) > 0
    now = snapshot()
    for i, want in enumerate(snapshots + [now]):
        got = t.state_before(log[i:])
        for a, b in zip(want[:3], got[:3]):
            np.testing.assert_array_equal(a, host(b))
        assert want[3] == got.clock
        if admit_after > 1:
            for a, b in zip(want[4], got.admission):
                np.testing.assert_array_equal(a, b)
    # Nothing changed: the table is as the last call left it.
    for a, b in zip(now[:4], snapshot()[:4]):
        np.testing.assert_array_equal(a, b)
