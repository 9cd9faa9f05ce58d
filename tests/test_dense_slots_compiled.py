"""The compiled host map and moves of a table with ``cache_rows``.

`DenseSlots.assign` compiled (`keras_sparse.ops.native_cache`) against its
NumPy passes, element for element, on random id streams with many
evictions; `assign_and_move` (map and moves in one call, in place) against
`assign` plus `DenseMoves.move` on a whole table; refusals leave every
array as it was; the fallback is said, not silent.
"""

import os

import numpy as np
import pytest

from keras_sparse import store as row_stores
from keras_sparse.layers.row_storage.dense_moves import DenseMoves
from keras_sparse.layers.row_storage.dense_slots import DenseSlots
from keras_sparse.ops import native_cache

VOCAB, CACHE, N = 300, 24, 20

pytestmark = pytest.mark.skipif(
    native_cache.library() is None, reason=native_cache.status()
)


def _state(slots):
    arrays = [slots.slot_of_id, slots.id_of_slot, slots.referenced, slots.used_in]
    return [a.copy() for a in arrays] + [slots.hand, slots.calls, dict(slots.counts)]


def _assert_same(a, b):
    for x, y in zip(_state(a), _state(b)):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y


def _batch(rng):
    ids = (rng.zipf(1.2, N) * 7919 % VOCAB).astype(rng.choice(["int32", "int64"]))
    return ids, rng.random(N) < 0.85


@pytest.mark.parametrize("seed", range(3))
def test_compiled_map_equals_the_numpy_map(seed):
    rng = np.random.default_rng(seed)
    fast, ref = DenseSlots("t", VOCAB, CACHE), DenseSlots("t", VOCAB, CACHE, False)
    assert fast.compiled() is not None and ref.compiled() is None
    for step in range(150):
        ids, use = _batch(rng)
        if step % 17 == 5:  # refusals: same error, nothing changed
            bad = ids.astype("int64")
            bad[rng.integers(N)] = rng.choice([-1, VOCAB, VOCAB + 5])
            use[:] = True
            errors = []
            for slots in (fast, ref):
                before = _state(slots)
                with pytest.raises(ValueError, match="out of range") as error:
                    slots.assign(bad, use)
                _assert_same_state(slots, before)
                errors.append(str(error.value))
            assert errors[0] == errors[1]
            big = rng.permutation(VOCAB)[: CACHE + 3]
            for slots in (fast, ref):
                before = _state(slots)
                with pytest.raises(RuntimeError, match="found no cache row"):
                    slots.assign(big, np.ones(big.size, bool))
                _assert_same_state(slots, before)
            continue
        got, want = fast.assign(ids, use), ref.assign(ids, use)
        for x, y in zip(got, want):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)
        _assert_same(fast, ref)
    assert fast.counts["evictions"] > 300  # the streams evicted a lot


def _assert_same_state(slots, before):
    for x, y in zip(_state(slots), before):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y


def _store(name):
    fields = (
        row_stores.FieldSpec("values", 3, "float32"),
        row_stores.FieldSpec("acc", 1, "float32"),
    )

    def init(first, end):
        ids = np.arange(first, end, dtype="float32")[:, None]
        return {"values": np.hstack([ids, -ids, ids / 2]), "acc": ids * 0 + 0.5}

    return row_stores.get("host").open_dense(fields, VOCAB, init, name=name)


def test_map_and_move_in_place_equals_map_then_moves():
    """Each step adds 1 to the rows of its ids, on the cache's arrays: the
    one-call route and the two-call route (plans, gathered rows, fills)
    keep the same cache arrays, store and counters throughout."""
    rng = np.random.default_rng(7)
    routes = []
    for name in ("one", "two"):
        cache = {"table": np.zeros((CACHE, 3), "f4"), "acc": np.zeros((CACHE, 1), "f4")}
        routes.append(
            (
                DenseSlots("t", VOCAB, CACHE),
                DenseMoves("t", _store(name), ["acc"]),
                cache,
            )
        )
    (one, one_moves, one_cache), (two, two_moves, two_cache) = routes
    assert one_moves.in_place({"table": ("float32", 3), "acc": ("float32", 1)})
    assert not one_moves.in_place({"table": ("float16", 3), "acc": ("float32", 1)})
    for step in range(60):
        ids, use = _batch(rng)
        if step == 30:  # out of range: raises, nothing moved
            stored = {k: v.copy() for k, v in one_moves.store.row_arrays().items()}
            held = {k: v.copy() for k, v in one_cache.items()}
            bad = ids.copy()
            bad[0], use[0] = VOCAB, True
            with pytest.raises(ValueError, match=f"id {VOCAB} is out of range"):
                one_moves.assign_and_move(one, bad, use, np.empty(N, "i4"), one_cache)
            for k, v in one_moves.store.row_arrays().items():
                np.testing.assert_array_equal(v, stored[k])
            for k, v in one_cache.items():
                np.testing.assert_array_equal(v, held[k])
        slots = np.full(N, 99, "i4")
        one_moves.assign_and_move(one, ids, use, slots, one_cache)
        rows, fill, evicted = two.assign(ids, use)
        two_moves.record(ids, fill, evicted)
        safe = np.where(fill, rows, 0)
        before = {k: v[safe] for k, v in two_cache.items()}
        filled, fills = two_moves.move(rows, fill, before)
        for k, v in two_cache.items():
            v[rows[filled]] = fills[k][filled]
        np.testing.assert_array_equal(slots, rows)
        for cache, at in ((one_cache, slots), (two_cache, rows)):
            distinct = np.unique(at[use])
            cache["table"][distinct] += 1
            cache["acc"][distinct] += 2
        _assert_same(one, two)
        for k in one_cache:
            np.testing.assert_array_equal(one_cache[k], two_cache[k])
    for k, v in two_moves.store.row_arrays().items():
        np.testing.assert_array_equal(
            one_moves.store.row_arrays()[k][:VOCAB], v[:VOCAB]
        )
    assert one_moves.counts == two_moves.counts
    assert one_moves.counts["write_backs"] > 100
    assert one_moves.pending() == 0
    one_stats, two_stats = one_moves.store.stats(), two_moves.store.stats()
    for key in ("reads", "writes", "hits"):
        assert one_stats[key] == two_stats[key], key


def test_without_the_library_the_numpy_map_runs_and_says_so(monkeypatch):
    import keras_sparse as ks

    monkeypatch.setattr(native_cache, "library", lambda: None)
    slots = DenseSlots("t", VOCAB, CACHE)
    assert slots.compiled() is None
    ids = np.arange(5)
    np.testing.assert_array_equal(slots.assign(ids, np.ones(5, bool))[0], ids)
    monkeypatch.setenv("KERAS_SPARSE_NATIVE", "0")
    built, why = native_cache._LIBRARY.build()
    assert built is None and why == "off: KERAS_SPARSE_NATIVE=0"
    monkeypatch.setattr(native_cache, "status", lambda: why)
    assert ks.compiled_cpu_helpers().endswith(
        "; cache_rows map and moves: NumPy (KERAS_SPARSE_NATIVE=0)"
    )


@pytest.mark.skipif(
    not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc/self/smaps"
)
def test_dense_disk_maps_are_advised_random_on_open_and_reopen(tmp_path):
    """A step reads scattered rows: no readahead around each (``rr``)."""
    fields = (row_stores.FieldSpec("values", 2, "float32"),)
    store = row_stores.DenseDiskStore(tmp_path / "d", fields, 5000)
    flags = _row_file_flags(tmp_path / "d")
    assert len(flags) == 1 and all("rr" in f for f in flags.values()), flags
    store.close()
    again = row_stores.DenseDiskStore.open(tmp_path / "d")
    flags = _row_file_flags(tmp_path / "d")
    assert len(flags) == 1 and all("rr" in f for f in flags.values()), flags
    again.close()


def _row_file_flags(folder):
    """``{row file: VmFlags}`` of this process's maps of ``folder``'s row
    files (Linux ``/proc/self/smaps``)."""
    flags, current = {}, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if len(head) >= 6 and "-" in head[0] and head[-1].endswith(".rows"):
                current = head[-1] if head[-1].startswith(str(folder)) else None
            elif line.startswith("VmFlags:") and current is not None:
                flags[current] = line.split()[1:]
                current = None
    return flags


def _fit(compiled, ids, target):
    import keras

    import keras_sparse as ks

    keras.utils.set_random_seed(5)
    inputs = keras.Input((2,), dtype="int32")
    layer = ks.AllToAllDenseEmbedding(
        VOCAB, 4, combiner="sum", optimizer=ks.optimizers.Adagrad(0.1),
        cache_rows=CACHE, store="host", name="ids",
    )  # fmt: skip
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(layer(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    layer.row_cache.slot_map.native = compiled
    model.fit(ids, target, batch_size=8, shuffle=False, verbose=0)
    return layer


def test_a_training_step_maps_and_moves_in_one_call_where_it_can(monkeypatch):
    """JAX (a compiled one-device CPU step) and PyTorch (eager, CPU) map and
    move in one compiled call on the variables themselves, TensorFlow in
    two hops; every route trains as the NumPy map's two hops, to the bit."""
    import keras

    calls = []
    one_call = DenseMoves.assign_and_move

    def counted(self, *args):
        calls.append(1)
        return one_call(self, *args)

    monkeypatch.setattr(DenseMoves, "assign_and_move", counted)
    rng = np.random.default_rng(2)
    ids = (rng.zipf(1.2, (96, 2)) * 7919 % VOCAB).astype("int32")
    target = rng.normal(size=(96, 1)).astype("float32")
    fast = _fit(True, ids, target)
    want = 12 if keras.backend.backend() in ("jax", "torch") else 0
    assert len(calls) == want
    slow = _fit(False, ids, target)
    assert len(calls) == want  # the NumPy map: two hops
    assert fast.stats() == slow.stats() and fast.stats()["write_backs"] > 50
    for a, b in zip(fast.get_weights(), slow.get_weights()):
        np.testing.assert_array_equal(a, b)
