"""Delta exports of fixed-vocabulary tables: `AllToAllDenseEmbedding` and
`EmbeddingCollection` built with ``track_changes=True``.

Reference: the layer's full export at the end (every row), and a set model
of the ids each interval's batches held (the rows a sparse optimizer
changes).
"""

import os

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse.layers.hash.deltas import META

DIM, BAG, BATCH, VOCAB = 4, 3, 8, 64


def _records(delta):
    return {k: np.asarray(v) for k, v in delta.items() if k not in META}


def _assert_same(got, want):
    got, want = _records(got), _records(want)
    assert sorted(got) == sorted(want)
    for name in want:  # bit for bit: ids, values, slots
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _dense(name="user", rows=VOCAB, **kwargs):
    args = dict(combiner="sum", optimizer="adagrad", track_changes=True, name=name)
    args.update(kwargs)
    return ks.AllToAllDenseEmbedding(rows, DIM, **args)


def _model(layer):
    ids = keras.Input((BAG,), dtype="int32")
    model = keras.Model(ids, keras.layers.Dense(1)(layer(ids)))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def _data(steps, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, (steps * BATCH, BAG)).astype("int32")
    return ids, rng.normal(size=(steps * BATCH, 1)).astype("float32")


def _fit(model, x, y, lo, hi, **kwargs):
    part = slice(lo * BATCH, hi * BATCH)
    if isinstance(x, dict):
        x = {k: v[part] for k, v in x.items()}
    else:
        x = x[part]
    model.fit(x, y[part], batch_size=BATCH, shuffle=False, verbose=0, **kwargs)


@pytest.mark.parametrize("store", [None, "host"], ids=["variables", "row_store"])
def test_dense_deltas_applied_in_order_reproduce_the_table(store, tmp_path):
    """full(4) + delta(4, 7) + delta(7, 10) == full(10), values and Adagrad
    slots; each delta holds exactly the ids its steps looked up."""
    kwargs = {} if store is None else dict(cache_rows=32, store=store)
    layer = _dense(**kwargs)
    model = _model(layer)
    ids, y = _data(10)
    folder = os.path.join(tmp_path, "deltas")
    callback = ks.callbacks.DeltaExport(folder, every_n_steps=3, layers=["user"])
    chain = []
    for lo, hi in ((0, 4), (4, 7), (7, 10)):
        _fit(model, ids, y, lo, hi, callbacks=[callback])
        chain.append(layer.export(since_step=-1 if lo == 0 else lo))
        assert int(chain[-1]["step"]) == hi
    # Files at steps 0 (full), 3, 4, 7, 10: atomic, chained by the callback.
    assert len(os.listdir(folder)) == 5
    _assert_same(ks.callbacks.DeltaExport.read(folder, "user"), layer.export())
    assert len(chain[0]["keys"]) == VOCAB  # every row
    for delta, (lo, hi) in zip(chain[1:], ((4, 7), (7, 10))):
        seen = set(ids[lo * BATCH : hi * BATCH].ravel().tolist())
        assert set(delta["keys"].tolist()) == seen
        assert len(delta["removed_keys"]) == 0
        assert sorted(_records(delta)) == ["accumulator", "keys", "values"]
    _assert_same(ks.apply_delta(*chain), layer.export())
    if store is None:  # the exported values are the table variable's
        table = keras.ops.convert_to_numpy(layer.embeddings)
        np.testing.assert_array_equal(layer.export()["values"], table)
    with pytest.raises(ValueError, match=r"'user'.*since_step.*\[0, 10\]"):
        layer.export(since_step=11)
    with pytest.raises(ValueError, match=r"covers steps \(7, 10\].*at step 4"):
        ks.apply_delta(chain[0], chain[2])
    with pytest.raises(ValueError, match="dtype"):
        ks.apply_delta(chain[0], dict(chain[1], dtype=np.str_("float16")))
    with pytest.raises(ValueError, match="layer 'item'.*layer 'user'"):
        ks.apply_delta(chain[0], dict(chain[1], layer=np.str_("item")))
    missing = ks.callbacks.DeltaExport(folder, every_n_steps=3, layers=["nope"])
    with pytest.raises(ValueError, match="'nope'.*tracked: \\['user'\\]"):
        _fit(model, ids, y, 0, 1, callbacks=[missing])


def test_set_weights_and_loads_mark_rows_and_carry_steps(tmp_path):
    """Rows changed by `set_weights` join the next delta; a weights file
    carries the change steps, so a loaded layer gives the same deltas."""
    layer = _dense()
    model = _model(layer)
    ids, y = _data(3)
    _fit(model, ids, y, 0, 3)
    weights = [np.array(w) for w in layer.get_weights()]
    at = {w.path.split("/")[-1]: i for i, w in enumerate(layer.weights)}
    weights[at["embeddings"]][[5, 60]] += 1.0
    weights[at["accumulator"]][7] += 1.0  # a slot only
    layer.set_weights(weights)
    assert layer.export(since_step=3)["keys"].tolist() == [5, 7, 60]
    path = os.path.join(tmp_path, "w.weights.h5")
    model.save_weights(path)
    fresh = _dense()
    fresh_model = _model(fresh)
    fresh_model.load_weights(path)
    for since in (-1, 1, 3):
        _assert_same(fresh.export(since_step=since), layer.export(since_step=since))
    store = {}
    layer.save_own_variables(store)
    store["change_steps"] = store["change_steps"][:5]
    store["0"] = store["0"] + 1.0  # would show, were anything loaded
    with pytest.raises(ValueError, match=r"'user'.*change_steps.*\(64,\)"):
        fresh.load_own_variables(store)
    _assert_same(fresh.export(), layer.export())  # nothing was loaded
    # Weights without steps, into a layer of other values: every row is
    # marked after the layer's step.
    other = _dense("other")
    _model(other)
    other.set_weights(weights)
    assert len(other.export(since_step=0)["keys"]) == VOCAB
    plain = _dense("plain", track_changes=False)
    with pytest.raises(ValueError, match="'plain'.*track_changes=True"):
        plain.export(since_step=0)


def test_tracking_needs_a_sparse_optimizer():
    with pytest.raises(ValueError, match="'dense'.*`track_changes=True`.*optimizer"):
        ks.AllToAllDenseEmbedding(8, 2, track_changes=True, name="dense")
    with pytest.raises(ValueError, match="'bad'.*track_changes.*True or False"):
        _dense("bad", track_changes="yes")
    with pytest.raises(ValueError, match="'coll'.*`track_changes=True`.*optimizer"):
        ks.EmbeddingCollection(
            {"a": ks.TableConfig(8, 2)}, track_changes=True, name="coll"
        )
    quantized = _dense("frozen")
    quantized(np.array([[1, 2, 3]]))
    quantized.quantize("int8")
    with pytest.raises(ValueError, match="'frozen'.*quantized"):
        quantized.export(since_step=-1)
    store = {}
    quantized.save_own_variables(store)  # Keras's quantized entries only
    assert "change_steps" not in store
    quantized.set_weights(quantized.get_weights())
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        layer = _dense("mirrored")
        with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
            with pytest.raises(ValueError, match="'mirrored'.*several tensorflow"):
                layer.build()


def _collection():
    tables = {
        "user": ks.TableConfig(40, DIM, combiner="sum"),
        "item": ks.TableConfig(30, DIM),
        "big": ks.TableConfig(50, DIM, combiner="mean", cache_rows=40, store="host"),
    }
    coll = ks.EmbeddingCollection(
        tables, optimizer="adam", track_changes=True, name="features"
    )
    shapes = {"user": (3,), "item": (), "big": (2,)}
    inputs = {n: keras.Input(s, dtype="int32", name=n) for n, s in shapes.items()}
    out = coll(inputs)
    joined = keras.layers.Concatenate()([out[n] for n in shapes])
    model = keras.Model(inputs, keras.layers.Dense(1)(joined))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    rng = np.random.default_rng(1)
    x = {
        n: rng.integers(0, tables[n].input_dim, (10 * BATCH,) + s).astype("int32")
        for n, s in shapes.items()
    }
    return coll, model, x, rng.normal(size=(10 * BATCH, 1)).astype("float32")


def test_collection_deltas_per_table_with_a_row_store(tmp_path):
    """Each table's deltas (stacked tables and a cached one, Adam slots)
    rebuild it; `DeltaExport` writes a chain per table in the collection's
    folder, and `set_table` marks the rows it changed."""
    coll, model, x, y = _collection()
    callback = ks.callbacks.DeltaExport(tmp_path, every_n_steps=3, layers=["features"])
    chain = []
    for lo, hi in ((0, 4), (4, 7), (7, 10)):
        kwargs = {"callbacks": [callback]} if lo == 0 else {}
        _fit(model, x, y, lo, hi, **kwargs)
        chain.append(coll.export(since_step=-1 if lo == 0 else lo))
    for name in x:
        seen = set(x[name][4 * BATCH : 7 * BATCH].ravel().tolist())
        assert set(chain[1][name]["keys"].tolist()) == seen
        assert str(chain[1][name]["layer"]) == f"features/{name}"
    full = coll.export()
    applied = ks.apply_delta(*chain)
    for name in x:
        _assert_same(applied[name], full[name])
    # The callback's chain (steps 0, 3, 4) ends where its fit ended.
    files = sorted(os.listdir(os.path.join(tmp_path, "features")))
    assert files[0] == "big.00000000.full.npz" and len(files) == 9
    at_four = ks.apply_delta(*chain[:1])
    for name in x:
        _assert_same(
            ks.callbacks.DeltaExport.read(tmp_path, f"features/{name}"),
            at_four[name],
        )
    item = coll.get_table("item").copy()
    item[[2, 9]] -= 1.0
    coll.set_table("item", item)
    delta = coll.export(since_step=10, tables=["item", "user"])
    assert delta["item"]["keys"].tolist() == [2, 9]
    assert len(delta["user"]["keys"]) == 0 and sorted(delta) == ["item", "user"]


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX sharding")
def test_sharded_tables_on_eight_devices():
    """A row-sharded layer (61 rows, padded to 64 over 8 devices) and a
    collection's table-wise and row-sharded tables: each delta holds the
    ids its steps looked up, unpadded, and each chain rebuilds its table."""
    from keras_sparse import sharding

    layer = _dense("solo", rows=61, sharding="row")
    tables = {
        "a": ks.TableConfig(40, DIM, combiner="sum", sharding="table"),
        "b": ks.TableConfig(30, DIM, sharding="table"),
        "c": ks.TableConfig(61, DIM, combiner="sum", sharding="row"),
    }
    coll = ks.EmbeddingCollection(
        tables, optimizer="adagrad", track_changes=True, name="features"
    )
    shapes = {"d": (BAG,), "a": (BAG,), "b": (), "c": (2,)}
    rng = np.random.default_rng(3)
    rows = {"d": 61, "a": 40, "b": 30, "c": 61}
    x = {n: rng.integers(0, rows[n], (7 * BATCH,) + s) for n, s in shapes.items()}
    x = {n: v.astype("int32") for n, v in x.items()}
    y = rng.normal(size=(7 * BATCH, 1)).astype("float32")
    keras.distribution.set_distribution(sharding.distribution([layer, coll], 8))
    try:
        inputs = {n: keras.Input(s, dtype="int32", name=n) for n, s in shapes.items()}
        out = coll({n: inputs[n] for n in tables})
        out["d"] = layer(inputs["d"])
        joined = keras.layers.Concatenate()([out[n] for n in shapes])
        model = keras.Model(inputs, keras.layers.Dense(1)(joined))
        model.compile(keras.optimizers.SGD(0.1), "mse")
        assert layer.embeddings.shape == (64, DIM)
        _fit(model, x, y, 0, 4)
        chain = [dict(coll.export(), d=layer.export())]
        _fit(model, x, y, 4, 7)
        chain.append(dict(coll.export(since_step=4), d=layer.export(since_step=4)))
        full = dict(coll.export(), d=layer.export())
    finally:
        keras.distribution.set_distribution(None)
    applied = ks.apply_delta(*chain)
    for name in shapes:
        assert chain[0][name]["values"].shape == (rows[name], DIM)
        seen = set(x[name][4 * BATCH : 7 * BATCH].ravel().tolist())
        assert set(chain[1][name]["keys"].tolist()) == seen, name
        _assert_same(applied[name], full[name])
