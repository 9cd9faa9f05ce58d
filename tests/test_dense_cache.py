"""A fixed-vocabulary layer with ``cache_rows`` trains as one without.

The layer under test keeps 64 of its 5000 rows on the device and the whole
table in a dense row store; the reference is a plain
`AllToAllDenseEmbedding` whose initial table is the store's initial content.
Both train through ``model.fit`` (a compiled step on JAX and TensorFlow,
eager on PyTorch) on the same Zipf-distributed batches; every id's values
and optimizer slots must match.
"""

import keras
import numpy as np
import pytest

import keras_sparse as ks

VOCAB, DIM, CACHE = 5000, 4, 64
BATCH, FIELDS, STEPS = 8, 2, 40


def _batches(seed, steps=STEPS):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, VOCAB + 1) ** 1.1
    ranks = rng.choice(VOCAB, size=(steps * BATCH, FIELDS), p=p / p.sum())
    ids = rng.permutation(VOCAB)[ranks].astype("int32")  # hot ids anywhere
    target = rng.normal(size=(steps * BATCH, 1)).astype("float32")
    return ids, target


def _optimizer(name):
    return {
        "sgd": ks.optimizers.SGD(0.3),
        "adagrad": ks.optimizers.Adagrad(0.1),
        "adam": ks.optimizers.Adam(0.05),
    }[name]


def _model(optimizer, **cache):
    inputs = keras.Input((FIELDS,), dtype="int32")
    extra = {}
    if optimizer == "sgd":  # row regularizer and constraint reach the cache
        extra = {"embeddings_regularizer": "l2", "embeddings_constraint": "non_neg"}
    layer = ks.AllToAllDenseEmbedding(
        VOCAB, DIM, combiner="sum", optimizer=_optimizer(optimizer), name="ids",
        **extra, **cache,
    )  # fmt: skip
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(layer(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    return model, layer


def _reference(optimizer, cached_model, cached_layer):
    """A plain layer's model starting where the cached one starts."""
    model, layer = _model(optimizer)
    table, *_ = cached_layer.get_weights()
    layer.embeddings.assign(table)
    model.get_layer("out").set_weights(cached_model.get_layer("out").get_weights())
    return model, layer


def _plain_state(layer):
    return [np.asarray(layer.embeddings), *map(np.asarray, layer.slots.values())]


@pytest.mark.parametrize(
    "optimizer, staged",
    [("sgd", False), ("adagrad", False), ("adam", False), ("adagrad", True)],
)
def test_cache_trains_as_the_whole_table(optimizer, staged):
    keras.utils.set_random_seed(3)
    cached, layer = _model(optimizer, cache_rows=CACHE, store="host")
    full, plain = _reference(optimizer, cached, layer)
    ids, target = _batches(0)
    full.fit(ids, target, batch_size=BATCH, shuffle=False, verbose=0)
    if staged:  # through the input stage: the cache maps ids in the step
        data = ks.data.prefetch((ids, target), cached, batch_size=BATCH)
        cached.fit(data, verbose=0)
    else:
        cached.fit(ids, target, batch_size=BATCH, shuffle=False, verbose=0)
    stats = layer.stats()
    assert stats["evictions"] > 50 and stats["write_backs"] == stats["evictions"]
    assert stats["fills"] == stats["misses"] and stats["store_size"] == VOCAB
    got = layer.get_weights()
    want = _plain_state(plain)
    assert len(got) == len(want) + 1
    for a, b in zip(got, want):
        assert a.shape == (VOCAB, b.shape[1])
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(got[-1]) == int(np.asarray(plain.sparse_iterations)) == STEPS
    # Inference reads the ids the cache does not hold from the store.
    probe = np.arange(VOCAB, dtype="int32").reshape(-1, FIELDS)[:64]
    np.testing.assert_allclose(
        cached.predict(probe, verbose=0), full.predict(probe, verbose=0),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip
    assert layer.stats()["store_hits"] > 0


def test_save_and_load_continue_identically(tmp_path):
    keras.utils.set_random_seed(4)
    spec = ks.store.Disk(tmp_path / "rows")
    cached, layer = _model("adam", cache_rows=CACHE, store=spec)
    ids, target = _batches(1)
    half = STEPS // 2 * BATCH
    cached.fit(ids[:half], target[:half], batch_size=BATCH, shuffle=False, verbose=0)
    path = tmp_path / "m.keras"
    cached.save(path)
    before = layer.get_weights()
    loaded = keras.models.load_model(path)
    again = loaded.get_layer("ids")
    assert again.cache_rows == CACHE and again.store == spec
    for a, b in zip(again.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    for model in (cached, loaded):
        model.fit(ids[half:], target[half:], batch_size=BATCH, shuffle=False, verbose=0)
    for a, b in zip(layer.get_weights(), again.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_set_weights_round_trips_the_whole_table():
    layer = ks.AllToAllDenseEmbedding(300, 3, cache_rows=64, optimizer="adagrad")
    layer(np.array([[1, 2]]), training=True)
    rng = np.random.default_rng(0)
    new = [rng.normal(size=(300, 3)).astype("float32"), np.full((300, 3), 0.5, "f4")]
    layer.set_weights(new + [np.int32(7)])
    got = layer.get_weights()
    for a, b in zip(got, new):
        np.testing.assert_array_equal(a, b)
    assert int(got[-1]) == 7
    assert layer.stats()["size"] == 0  # the cache was emptied
    out = layer(np.array([[5, 299]]), training=False)
    np.testing.assert_allclose(np.asarray(out)[0], new[0][[5, 299]], rtol=1e-6)
    with pytest.raises(ValueError, match="whole table"):
        layer.set_weights(new)


def test_out_of_range_ids_raise_before_anything_changes():
    layer = ks.AllToAllDenseEmbedding(300, 3, cache_rows=64, optimizer="sgd")
    layer(np.array([[1, 2]]), training=True)
    before = layer.get_weights()
    for bad in (np.array([[3, 300]]), keras.ops.convert_to_tensor([[-1, 3]])):
        with pytest.raises(ValueError, match=r"\[0, 300\)"):
            layer(bad, training=True)
    assert layer.stats()["size"] == 2
    for a, b in zip(layer.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    # The cache's records: each id once, cached ids with their cached rows.
    records = layer.row_cache.export()
    order = np.argsort(records["keys"])
    np.testing.assert_array_equal(records["keys"][order], np.arange(300))
    np.testing.assert_array_equal(records["values"][order], before[0])


def test_out_of_range_ids_abort_a_compiled_step():
    keras.utils.set_random_seed(5)
    model, _ = _model("sgd", cache_rows=CACHE)
    ids, target = _batches(2, steps=2)
    ids[BATCH + 1, 0] = VOCAB
    with pytest.raises(Exception, match=r"out of range"):
        model.fit(ids, target, batch_size=BATCH, shuffle=False, verbose=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cache_rows": 64, "optimizer": None}, "needs a sparse `optimizer`"),
        ({"cache_rows": 0}, "cache_rows"),
        ({"cache_rows": 1001}, r"\[1, input_dim=1000\]"),
        ({"cache_rows": True}, "cache_rows"),
        ({"store": "host"}, "needs `cache_rows`"),
        ({"cache_rows": 64, "store": "nowhere"}, "`store`"),
        ({"cache_rows": 64, "sharding": "row"}, "`sharding`='row'"),
        ({"cache_rows": 64, "mask_zero": True}, "`mask_zero`"),
        ({"cache_rows": 64, "lora_rank": 2}, "`lora_rank`"),
        (
            {"cache_rows": 64, "embeddings_initializer": "orthogonal"},
            "embeddings_initializer",
        ),
    ],
)
def test_refusals_name_the_argument(kwargs, match):
    kwargs = {"optimizer": "sgd", **kwargs}
    with pytest.raises(ValueError, match=match) as info:
        ks.AllToAllDenseEmbedding(1000, 4, name="big", **kwargs)
    assert "'big'" in str(info.value)


def test_stats_needs_a_cache():
    with pytest.raises(ValueError, match="cache_rows=None"):
        ks.AllToAllDenseEmbedding(10, 2).stats()


def test_initial_table_does_not_depend_on_chunks(monkeypatch):
    from keras_sparse.store import dense_store

    def table(vocab):
        init = keras.initializers.RandomNormal(seed=11)
        layer = ks.AllToAllDenseEmbedding(
            vocab, 3, cache_rows=64, optimizer="adam", embeddings_initializer=init
        )
        return layer.get_weights()

    whole = table(700)
    monkeypatch.setattr(dense_store, "INIT_CHUNK_BYTES", 100)  # 5 rows a chunk
    chunked = table(700)
    # Up to rounding: TensorFlow's vectorized erfinv may differ by an ulp.
    for a, b in zip(whole, chunked):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
    # Each id's row is its own: a function of (seed, id) only.
    np.testing.assert_allclose(table(300)[0], whole[0][:300], rtol=1e-6, atol=1e-8)
    assert 0.5 < np.std(whole[0]) / 0.05 < 1.5  # RandomNormal's spread
    np.testing.assert_array_equal(whole[1], 0)  # Adam's slots start at 0


def test_a_batch_without_cache_rows_for_all_ids_raises():
    layer = ks.AllToAllDenseEmbedding(300, 3, cache_rows=64, optimizer="sgd")
    layer(np.arange(40).reshape(20, 2), training=True)
    before, counts = layer.get_weights(), layer.stats()
    with pytest.raises(RuntimeError, match="found no cache row"):
        layer(np.arange(100, 230).reshape(65, 2), training=True)  # 130 > 64
    assert layer.stats() == counts
    for a, b in zip(layer.get_weights(), before):
        np.testing.assert_array_equal(a, b)
