"""DistributedHashEmbedding state survives save/load and export/import_.

The reference is a plain dict ``{key: (vector, {slot: value}, score)}``
updated by what each operation is specified to do; the layer must match it
exactly after every operation.
"""

import functools
import os
import re
import tempfile
import warnings

import h5py
import keras
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from keras_sparse.layers.hash.embedding import DistributedHashEmbedding
from keras_sparse.table import HashTable
from keras_sparse.table import TableFullError

DIM = 3
CAPACITY = 64  # 4 buckets of 16: fills up within a few batches
NAME = "hashed"
NEW_ENTRIES = (
    "record_rows",
    "table_capacity",
    "table_bucket_size",
    "table_seed",
    "table_clock",
)


def _layer(capacity=CAPACITY, eviction="lru", admit_after=1, optimizer="adagrad"):
    return DistributedHashEmbedding(
        DIM,
        capacity=capacity,
        combiner="sum",
        optimizer=optimizer,
        eviction=eviction,
        admit_after=admit_after,
        name=NAME,
    )


def _model(layer, bag=2):
    ids = keras.Input((bag,), dtype="int32")
    model = keras.Model(ids, layer(ids))
    model.compile(keras.optimizers.SGD(0.0), "mse")
    return model


def _train_on(model, keys, rng, batch=8):
    """One compiled training step on ``keys`` (``batch * 2`` of them); eager
    steps would take seconds each on JAX."""
    x = np.asarray(keys).reshape(batch, 2).astype("int32")
    model.train_on_batch(x, rng.normal(size=(batch, DIM)).astype("float32"))


def _train(model, rng, pool):
    keys = rng.choice(pool, size=16)
    _train_on(model, keys, rng)
    return set(keys.tolist())


def _fill(model, rng, num_keys, sightings=1, batch=8):
    """Trains on ``num_keys`` new random keys until the table is full."""
    keys = rng.choice(2**31 - 1, size=num_keys, replace=False)
    for chunk in np.split(keys, num_keys // (2 * batch)):
        for _ in range(sightings):
            _train_on(model, chunk, rng, batch)
    layer = model.layers[-1]
    assert layer.stats()["size"] == layer.capacity


def _store(layer):
    store = {}
    layer.save_own_variables(store)
    return store


def _assert_same_store(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        if name in ("admission_keys", "admission_sightings"):
            continue
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    if "admission_keys" in a:
        _assert_same_pending(a, b)


def _assert_same_pending(a, b):
    """Equal pending admission counts; a pending table filled to its cap
    (CAPACITY keys) may place one of them nowhere on load (forgotten)."""
    got, want = (
        dict(zip(s["admission_keys"].tolist(), s["admission_sightings"].tolist()))
        for s in (a, b)
    )
    if len(got) != len(want) and max(len(got), len(want)) >= CAPACITY:
        small, big = sorted((got, want), key=len)
        assert all(big[k] == c for k, c in small.items())
        return
    assert got == want


def _slot_names(layer):
    return [spec.name for spec in layer.sparse_optimizer.slot_specs()]


def _records(layer):
    """The layer's live keys as ``{key: (vector, {slot: value}, score)}``."""
    rec = layer.export()
    slots = _slot_names(layer)
    return {
        int(k): (
            rec["values"][i],
            {s: rec[s][i] for s in slots},
            int(rec["scores"][i]),
        )
        for i, k in enumerate(rec["keys"].tolist())
    }


def _same_entry(a, b):
    return (
        np.array_equal(a[0], b[0])
        and sorted(a[1]) == sorted(b[1])
        and all(np.array_equal(a[1][s], b[1][s]) for s in a[1])
        and a[2] == b[2]
    )


def _mismatches(layer, ref):
    got = _records(layer)
    bad = [f"missing key {k}" for k in ref.keys() - got.keys()]
    bad += [f"unexpected key {k}" for k in got.keys() - ref.keys()]
    bad += [
        f"key {k}: {got[k]} != {ref[k]}"
        for k in ref.keys() & got.keys()
        if not _same_entry(got[k], ref[k])
    ]
    return bad


def _buckets_full_of_hotter(layer, key, score):
    """True when both candidate buckets of ``key`` are full of live keys
    with a score >= ``score`` (why a hottest-first load may drop it)."""
    rec = layer.export(include_rows=True)
    size = layer.table.bucket_size
    b1, b2 = (int(np.asarray(b)[0]) for b in layer.table.candidate_buckets([key]))
    for bucket in {b1, b2}:
        inside = rec["rows"] // size == bucket
        if inside.sum() != size or rec["scores"][inside].min() < score:
            return False
    return True


def _caught(fn, *args, **kwargs):
    """``(result, [warning messages])`` of ``fn``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    return result, [str(w.message) for w in caught]


# ------------------------------------------------------------ dict reference
def _checked_step(state, batch, step):
    """Runs ``step`` on the keys ``batch``: it may change only their state;
    other keys keep theirs exactly or are evicted (counted by the table)."""
    layer, ref = state["layer"], state["ref"]
    evictions = layer.stats()["evictions"]
    step()
    got = _records(layer)
    assert got.keys() - ref.keys() <= batch, "a key outside the batch appeared"
    gone = ref.keys() - got.keys()
    assert not gone & batch, "a key of the batch was evicted by its own step"
    assert len(gone) == layer.stats()["evictions"] - evictions
    for k in (ref.keys() & got.keys()) - batch:
        assert _same_entry(got[k], ref[k]), f"untouched key {k} changed"
    state["ref"] = {k: got[k] if k in batch else ref[k] for k in got}


def _op_train(state, seed):
    rng = np.random.default_rng(seed)
    x = rng.choice(state["pool"], size=(8, 2)).astype("int32")
    y = rng.normal(size=(8, DIM)).astype("float32")
    batch = set(x.reshape(-1).tolist())
    _checked_step(state, batch, lambda: state["model"].train_on_batch(x, y))


def _op_fill(state, seed):
    """Training on the whole pool, twice (admission): the table ends up full."""
    rng = np.random.default_rng(seed)
    pool = rng.permutation(state["pool"])
    for chunk in np.split(pool, len(pool) // 16) * 2:
        _checked_step(
            state,
            set(chunk.tolist()),
            lambda c=chunk: _train_on(state["model"], c, rng),
        )


def _op_save_load(state, directory):
    """A .keras round trip restores every key at its row, and loading it
    back over the live layer leaves that layer as it was."""
    layer, model = state["layer"], state["model"]
    path = os.path.join(directory, "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path).get_layer(NAME)
    assert _mismatches(loaded, state["ref"]) == []
    _assert_same_store(_store(loaded), _store(layer))
    before = _store(layer)
    layer.load_own_variables(_store(loaded))
    _assert_same_store(_store(layer), before)


def _op_export_import(state, with_rows):
    """import_ into a fresh layer: exact with rows; without, a subset whose
    every dropped key found both its buckets full, with a warning."""
    layer, ref = state["layer"], state["ref"]
    rec = layer.export(include_rows=with_rows)
    fresh = _layer(eviction=layer.eviction, admit_after=layer.admit_after)
    fresh.build()
    slots = {name: rec[name] for name in _slot_names(layer)}
    stored, messages = _caught(
        fresh.import_,
        rec["keys"],
        rec["values"],
        slots,
        rec["scores"],
        rows=rec.get("rows"),
    )
    kept = _records(fresh)
    assert stored == len(kept)
    assert _mismatches(fresh, {k: ref[k] for k in kept}) == []
    dropped = ref.keys() - kept.keys()
    assert bool(dropped) == any("import_ stored" in m for m in messages)
    if with_rows:
        assert not dropped
        np.testing.assert_array_equal(fresh.export(True)["rows"], rec["rows"])
    for key in dropped:
        assert _buckets_full_of_hotter(fresh, key, 0)
    assert _mismatches(layer, ref) == [], "export changed the source layer"


def _op_import(state, seed):
    """import_ of random records (some keys already live) into the layer."""
    layer, ref = state["layer"], state["ref"]
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 20))
    wide = rng.integers(-(2**62), 2**62, size=n)  # beyond int32 too
    candidates = np.unique(np.concatenate([list(ref) or [0], wide]))
    keys = rng.choice(candidates, size=min(n, len(candidates)), replace=False)
    n = len(keys)
    values = rng.normal(size=(n, DIM)).astype("float32")
    slots = {
        name: rng.uniform(0.1, 1.0, size=(n,) + tuple(var.shape[1:])).astype("float32")
        for name, var in layer.slots.items()
    }
    scores = rng.integers(0, 50, size=n)
    evictions = layer.stats()["evictions"]
    stored, messages = _caught(layer.import_, keys, values, slots, scores)
    got = _records(layer)
    new = {}
    for i, key in enumerate(keys.tolist()):
        if key in got:
            slot_values = {name: value[i] for name, value in slots.items()}
            new[key] = (values[i], slot_values, int(scores[i]))
        else:
            assert key not in ref, "a live key was dropped by import_"
    assert stored == len(new)
    assert (stored < n) == any("import_ stored" in m for m in messages)
    gone = ref.keys() - got.keys() - set(keys.tolist())
    assert len(gone) == layer.stats()["evictions"] - evictions
    ref = {k: v for k, v in ref.items() if k not in gone}
    ref.update(new)
    state["ref"] = ref


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("train"), st.integers(0, 2**32 - 1)),
        st.tuples(st.just("fill"), st.integers(0, 2**32 - 1)),
        st.tuples(st.just("save_load"), st.none()),
        st.tuples(st.just("export_import"), st.booleans()),
        st.tuples(st.just("import"), st.integers(0, 2**32 - 1)),
    ),
    min_size=1,
    max_size=8,
)


@pytest.mark.parametrize(
    "eviction, admit_after", [("lru", 1), ("lfu", 2)], ids=["lru", "lfu-admit2"]
)
def test_operations_match_dict_reference(eviction, admit_after):
    # One model per configuration (a JAX compile costs seconds); each
    # example starts from the empty state loaded into it.
    layer = _layer(eviction=eviction, admit_after=admit_after)
    model = _model(layer)
    empty = _store(layer)

    @settings(
        max_examples=6,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(seed=st.integers(0, 2**32 - 1), ops=_OPS)
    def run(seed, ops):
        layer.load_own_variables(empty)
        pool = np.random.default_rng(seed).choice(2**31 - 1, 3 * CAPACITY)
        state = {"layer": layer, "model": model, "ref": {}, "pool": pool}
        assert _mismatches(layer, state["ref"]) == []
        with tempfile.TemporaryDirectory() as directory:
            for op, arg in ops:
                if op == "train":
                    _op_train(state, arg)
                elif op == "fill":
                    _op_fill(state, arg)
                elif op == "save_load":
                    _op_save_load(state, directory)
                elif op == "export_import":
                    _op_export_import(state, arg)
                else:
                    _op_import(state, arg)
                assert _mismatches(layer, state["ref"]) == [], op

    run()


# ------------------------------------------------------- same-geometry loads
@pytest.mark.parametrize(
    "eviction, admit_after, optimizer",
    [("lru", 1, "adagrad"), ("lfu", 2, "adam"), ("lru", 2, "adam"), ("lfu", 1, "sgd")],
    ids=str,
)
def test_full_table_round_trip_keeps_rows_and_training_continues(
    tmp_path, eviction, admit_after, optimizer
):
    rng = np.random.default_rng(0)
    layer = _layer(eviction=eviction, admit_after=admit_after, optimizer=optimizer)
    model = _model(layer)
    _fill(model, rng, 4 * CAPACITY, sightings=admit_after)
    pool = layer.export()["keys"]
    for _ in range(3):  # optimizer slots and scores move away from their start
        _train(model, rng, pool)
    # Keys seen once, half-way to admission (admit_after=2).
    waiting = rng.choice(2**31 - 1, size=4, replace=False)
    _train_on(model, np.concatenate([waiting, pool[:12]]), rng)
    assert layer.stats()["size"] == layer.capacity
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded_model = keras.saving.load_model(path)
    loaded = loaded_model.get_layer(NAME)

    before, after = layer.export(include_rows=True), loaded.export(include_rows=True)
    assert sorted(before) == sorted(after)
    for name in before:  # row order: same rows, same keys, bit for bit
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    assert _mismatches(loaded, _records(layer)) == []
    # Same LRU clock, admission counts, step and seed: training goes on alike.
    batches = [np.concatenate([waiting, pool[:12]])] + [
        rng.choice(np.concatenate([pool, waiting, rng.integers(0, 2**31, 8)]), 16)
        for _ in range(3)
    ]
    for i, keys in enumerate(batches):
        x = keys.reshape(8, 2).astype("int32")
        y = rng.normal(size=(8, DIM)).astype("float32")
        model.train_on_batch(x, y)
        loaded_model.train_on_batch(x, y)
        a, b = layer.export(include_rows=True), loaded.export(include_rows=True)
        for name in a:
            np.testing.assert_array_equal(b[name], a[name], err_msg=name)
        if i == 0:  # seen again after the load: admitted (counts restored)
            assert set(waiting.tolist()) <= set(b["keys"].tolist())


def test_full_1024_key_table_keras_round_trip(tmp_path):
    layer = _layer(capacity=1024, optimizer="adagrad")
    model = _model(layer)
    _fill(model, np.random.default_rng(1), 64 * 80, batch=64)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path).get_layer(NAME)
    assert loaded.stats()["size"] == 1024
    _assert_same_store(_store(loaded), _store(layer))


def test_restored_table_inserts_like_the_original():
    # Exact rows leave buckets compact (fast placement) or holey (erase),
    # as in the source table; later inserts must land on the same rows.
    rng = np.random.default_rng(2)
    table = HashTable(256, eviction="lru", device="cpu")
    for step in range(1, 9):
        table.lookup_or_insert(rng.integers(0, 10**6, 24), step=step)
    keys, rows, scores = table.export()
    table.erase(keys[(rows < 64) & (rows % 16 == 0)])  # holes in 4 buckets
    keys, rows, scores = table.export()
    copy = HashTable(256, eviction="lru", device="cpu")
    copy.import_(keys, rows, scores)
    assert bool(copy._impl.holey.any()) and not bool(copy._impl.holey.all())
    for step in range(9, 30):
        batch = rng.integers(0, 10**6, 24)
        a = table.lookup_or_insert(batch, step=step)
        b = copy.lookup_or_insert(batch, step=step)
        np.testing.assert_array_equal(a.rows, b.rows)
    for x, y in zip(table.export(), copy.export()):
        np.testing.assert_array_equal(x, y)


# ---------------------------------------------------- other-geometry loads
def _saved_full_table(eviction="lfu", capacity=4 * CAPACITY):
    """A full table's store and records (scores vary: LFU counts or LRU
    steps); each test gets its own copy."""
    store, records = _build_full_table(eviction, capacity)
    return {k: np.array(v) for k, v in store.items()}, dict(records)


@functools.cache
def _build_full_table(eviction, capacity):
    rng = np.random.default_rng(3)
    layer = _layer(capacity=capacity, eviction=eviction)
    model = _model(layer)
    _fill(model, rng, 4 * capacity)
    keys = layer.export()["keys"]
    for _ in range(capacity // 16):  # uneven scores: some keys seen again
        _train(model, rng, keys[: capacity // 2])
    return _store(layer), _records(layer)


@pytest.mark.parametrize("eviction", [None, "lru", "lfu"], ids=str)
def test_load_into_smaller_table_keeps_hottest_and_warns(eviction):
    store, saved = _saved_full_table()
    target = _layer(eviction=eviction)
    target.build()
    _, messages = _caught(target.load_own_variables, store)
    kept = _records(target)
    assert 0 < len(kept) <= CAPACITY
    assert _mismatches(target, {k: saved[k] for k in kept}) == []
    dropped = saved.keys() - kept.keys()
    (message,) = [m for m in messages if "dropped on load" in m]
    assert f"Layer '{NAME}'" in message
    assert f"{len(dropped)} of {len(saved)} saved keys" in message
    assert f"capacity ({target.capacity})" in message
    for key in dropped:
        assert _buckets_full_of_hotter(target, key, saved[key][2]), key


def test_load_into_larger_table_keeps_every_key():
    store, saved = _saved_full_table(capacity=CAPACITY)
    target = _layer(capacity=16 * CAPACITY)
    target.build()
    _, messages = _caught(target.load_own_variables, store)
    assert _mismatches(target, saved) == []
    assert not [m for m in messages if "dropped" in m]


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_checkpoint_without_rows_still_loads(eviction):
    # Checkpoints written before rows, geometry and clock were saved.
    store, saved = _saved_full_table(eviction=eviction, capacity=CAPACITY)
    for name in NEW_ENTRIES:
        del store[name]
    target = _layer(eviction=eviction)
    target.build()
    _, messages = _caught(target.load_own_variables, store)
    kept = _records(target)
    assert _mismatches(target, {k: saved[k] for k in kept}) == []
    dropped = saved.keys() - kept.keys()
    assert bool(dropped) == any(
        f"{len(dropped)} of {len(saved)}" in m for m in messages
    )
    for key in dropped:
        assert _buckets_full_of_hotter(target, key, saved[key][2]), key
    if eviction == "lru":  # a new key is the most recent, not the oldest
        newest = max(score for _, _, score in saved.values())
        target.table.lookup_or_insert([2**31 - 1])  # as a training step does
        assert _records(target)[2**31 - 1][2] > newest


def test_checkpoint_restores_non_finite_values_as_saved():
    # import_ refuses NaN; a checkpoint is restored as it was written.
    store, saved = _saved_full_table(capacity=CAPACITY)
    store["record_values"] = store["record_values"].copy()
    store["record_values"][0, 1] = np.nan
    target = _layer()
    target.load_own_variables(store)
    got = target.export()
    i = got["keys"].tolist().index(int(store["record_keys"][0]))
    assert np.isnan(got["values"][i, 1])


# --------------------------------------------------------- import_ errors
def _populated(optimizer="adagrad", admit_after=1):
    """A layer holding a few keys with distinct vectors, slots and scores."""
    layer = _layer(optimizer=optimizer, admit_after=admit_after)
    layer.build()
    rng = np.random.default_rng(5)
    slots = {
        name: rng.uniform(0.1, 1.0, size=(4,) + tuple(var.shape[1:]))
        for name, var in layer.slots.items()
    }
    layer.import_([11, 12, 13, 14], rng.normal(size=(4, DIM)), slots, [3, 1, 4, 1])
    return layer


def _snapshot(layer):
    state = _store(layer)
    state.update({v.path: keras.ops.convert_to_numpy(v) for v in layer.variables})
    return state


def _bad_calls():
    n = 5
    keys = np.arange(100, 100 + n)
    values = np.ones((n, DIM), "float32")
    slots = {"accumulator": np.full((n, DIM), 0.5, "float32")}
    scores = np.arange(n)
    good = dict(keys=keys, values=values, slots=slots, scores=scores)

    def with_(**changes):
        return {**good, **changes}

    nan = values.copy()
    nan[2, 0] = np.nan
    inf_slot = {"accumulator": np.full((n, DIM), np.inf, "float32")}
    return {
        "values shape": (
            with_(values=np.ones((n, DIM + 1))),
            r"`values` must be a real array of shape \(5, 3\).*shape \(5, 4\)",
        ),
        "values flat": (with_(values=np.ones(n * DIM)), r"`values`.*\(15,\)"),
        "slot shape": (
            with_(slots={"accumulator": np.ones((n, 1))}),
            r"`slots\['accumulator'\]`.*\(5, 3\).*\(5, 1\)",
        ),
        "unknown slot": (
            with_(slots={**slots, "momentum": np.ones((n, DIM))}),
            r"unknown `slots` \['momentum'\].*\['accumulator'\]",
        ),
        "scores length": (with_(scores=np.arange(n + 1)), r"`scores`.*\(5,\)"),
        "scores negative": (
            with_(scores=-np.arange(n)),
            r"`scores` must be in \[0, 2\*\*62\)",
        ),
        "scores float": (with_(scores=np.ones(n) / 2), r"`scores`.*integer"),
        "duplicate keys": (
            with_(keys=np.array([100, 101, 100, 102, 103])),
            r"`keys` must be distinct.*\[100\]",
        ),
        "nan values": (with_(values=nan), r"`values` has 1 non-finite"),
        "inf slot": (with_(slots=inf_slot), r"`slots\['accumulator'\]` has 15 non"),
        "rows range": (
            with_(rows=np.array([0, 1, 2, 3, 64])),
            r"`rows` must be in \[0, 64\)",
        ),
        "rows repeated": (with_(rows=np.array([0, 1, 1, 2, 3])), "`rows` must be dis"),
        "float keys": (with_(keys=np.arange(n) + 0.5), "`keys`.*integers"),
        "slots not a dict": (with_(slots=[np.ones((n, DIM))]), "`slots` must be a"),
    }


@pytest.mark.parametrize("case", sorted(_bad_calls()))
def test_import_validates_everything_before_changing_anything(case):
    kwargs, match = _bad_calls()[case]
    layer = _populated()
    before = _snapshot(layer)
    with pytest.raises((ValueError, TypeError), match=f"Layer '{NAME}'.*{match}"):
        layer.import_(**kwargs)
    _assert_same_store(_snapshot(layer), before)


def test_import_rows_outside_the_keys_buckets_change_nothing():
    layer = _populated()
    keys = np.array([100, 101])
    b1, b2 = (np.asarray(b) for b in layer.table.candidate_buckets(keys))
    other = [b for b in range(layer.table.num_buckets) if b not in (b1[0], b2[0])]
    rows = np.array([other[0] * 16 + 15, b1[1] * 16 + 15])
    before = _snapshot(layer)
    with pytest.raises(ValueError, match=f"Layer '{NAME}': `rows` do not fit"):
        layer.import_(keys, np.ones((2, DIM)), rows=rows)
    _assert_same_store(_snapshot(layer), before)


def test_import_into_full_table_without_eviction_changes_nothing():
    layer = _layer(eviction=None)
    layer.import_(np.arange(20), np.ones((20, DIM)))
    before = _snapshot(layer)
    with pytest.raises(TableFullError, match=f"Layer '{NAME}'.*nothing was changed"):
        layer.import_(np.arange(1000, 1000 + CAPACITY - 10), np.ones((54, DIM)))
    _assert_same_store(_snapshot(layer), before)


def test_import_more_keys_than_capacity_warns():
    layer = _layer()
    n = 2 * CAPACITY
    scores = np.random.default_rng(4).permutation(n)
    stored, messages = _caught(
        layer.import_, np.arange(n), np.ones((n, DIM)), scores=scores
    )
    assert stored == layer.stats()["size"] <= CAPACITY
    (message,) = [m for m in messages if "import_ stored" in m]
    assert f"Layer '{NAME}': import_ stored {stored} of {n} keys" in message
    assert f"{n - CAPACITY} keys, the coldest" in message
    hottest = set(np.argsort(-scores)[:CAPACITY].tolist())
    assert set(layer.export()["keys"].tolist()) <= hottest


# ------------------------------------------------------- incomplete files
@pytest.mark.parametrize(
    "entry",
    [
        "record_keys",
        "record_values",
        "record_scores",
        "record_accumulator",
        "sparse_iterations",
        "seed_state",
        "admission_keys",
        "admission_sightings",
    ],
)
def test_load_refuses_a_missing_entry(entry):
    store = _store(_populated(admit_after=2))
    del store[entry]
    target = _layer(admit_after=2)
    target.import_([5], np.ones((1, DIM)))
    before = _snapshot(target)
    with pytest.raises(ValueError, match=f"Layer '{NAME}'.*lacks \\['{entry}'\\]"):
        target.load_own_variables(store)
    _assert_same_store(_snapshot(target), before)


def test_load_weights_refuses_a_file_missing_a_slot(tmp_path):
    layer = _populated()
    model = _model(layer, bag=4)
    path = os.path.join(tmp_path, "m.weights.h5")
    model.save_weights(path)
    with h5py.File(path, "a") as f:
        names = []
        f.visit(names.append)
        (slot,) = [n for n in names if n.endswith("record_accumulator")]
        del f[slot]
    other = _model(_layer(), bag=4)
    with pytest.raises(ValueError, match="lacks \\['record_accumulator'\\]"):
        other.load_weights(path)


def test_load_refuses_another_optimizers_slots():
    source = _populated(optimizer="adam")
    store = _store(source)
    target = _layer(optimizer="sgd")
    target.build()
    foreign = sorted(f"record_{name}" for name in _slot_names(source))
    with pytest.raises(ValueError, match=re.escape(f"optimizer slots {foreign}")):
        target.load_own_variables(store)
    assert target.stats()["size"] == 0


def test_load_refuses_a_wrongly_shaped_entry():
    store = _store(_populated())
    store["sparse_iterations"] = np.zeros(2, "int32")
    target = _layer()
    target.build()
    with pytest.raises(ValueError, match=r"`sparse_iterations`.*shape \(\)"):
        target.load_own_variables(store)
    assert target.stats()["size"] == 0


def test_admission_counts_are_optional_without_admission():
    source = _populated()
    store = _store(source)
    assert "admission_counts" not in store
    target = _layer()
    target.load_own_variables(store)
    assert _mismatches(target, _records(source)) == []


# ------------------------------------------------------- admission counts
def test_pending_admission_counts_continue_after_a_load():
    """Saved mid-stream and loaded (same or another capacity), a layer
    admits exactly the keys an uninterrupted one admits: those seen three
    times (a dict of sightings)."""
    rng = np.random.default_rng(4)
    batches = rng.integers(0, 150, size=(12, 8, 2))
    first = _layer(capacity=512, admit_after=3)
    for batch in batches[:6]:
        first(batch, training=True)
    store = _store(first)
    assert len(store["admission_keys"]) > 0
    resumed = []
    for capacity in (512, 1024):
        layer = _layer(capacity=capacity, admit_after=3)
        layer.build()
        layer.load_own_variables(store)
        resumed.append(layer)
    for batch in batches[6:]:
        for layer in [first, *resumed]:
            layer(batch, training=True)
    keys, times = np.unique(batches, return_counts=True)
    want = keys[times >= 3].tolist()
    for layer in [first, *resumed]:
        assert sorted(layer.export()["keys"].tolist()) == want


def test_count_min_checkpoint_loads_with_counts_restarted():
    """A checkpoint of the former count-min sketch holds no per-key counts:
    it loads, warns, and keys not admitted yet count from zero."""
    layer = _layer(admit_after=2)
    layer(np.array([[5, 6]]), training=True)  # pending
    store = _store(layer)
    del store["admission_keys"], store["admission_sightings"]
    store["admission_counts"] = np.ones((4, 1024), np.uint32)
    store["admission_seed"] = np.int64(0)
    with pytest.warns(UserWarning, match="count from zero|counting their sight"):
        layer.load_own_variables(store)
    assert len(layer.table._impl.admission) == 0
    layer(np.array([[5, 6]]), training=True)
    assert layer.export()["keys"].tolist() == []
