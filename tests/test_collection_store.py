"""`EmbeddingCollection` tables with ``cache_rows`` over a row store train
as the same collection without.

Table "a" keeps 128 of its 3000 rows on the device over a host store, "b"
96 of its 2000 over a disk store, "c" lives in the collection's variables.
The reference is the same collection without caches, starting from the
same tables; both train through ``model.fit`` (compiled on JAX, graph on
TensorFlow, eager on PyTorch; the cached one also through
``ks.data.prefetch``) on the same Zipf-distributed batches; every row and
optimizer slot of every table must match.
"""

import json
import types
import zipfile

import h5py
import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse.layers import collection_state
from keras_sparse.layers import store_assets
from keras_sparse.store import chunk_files
from tests import row_store_models as shared

TABLES = {"a": (3000, 2, "sum"), "b": (2000, 2, "mean"), "c": (500, 1, None)}
CACHES = {"a": 128, "b": 96}
DIM, BATCH, STEPS = 4, 16, 12


def _batches(seed, steps=STEPS):
    rng = np.random.default_rng(seed)
    x = {}
    for name, (vocab, width, _) in TABLES.items():
        p = 1.0 / np.arange(1, vocab + 1) ** 1.1
        ranks = rng.choice(vocab, size=(steps * BATCH, width), p=p / p.sum())
        x[name] = rng.permutation(vocab)[ranks].astype("int32")  # hot ids anywhere
    return x, rng.normal(size=(steps * BATCH, 1)).astype("float32")


def _optimizer(name):
    return {
        "sgd": ks.optimizers.SGD(0.3),
        "adagrad": ks.optimizers.Adagrad(0.1),
        "adam": ks.optimizers.Adam(0.05),
    }[name]


def _model(optimizer, stores=None):
    """A model over one collection; ``stores``: ``{table: store spec}`` of
    the tables given ``cache_rows`` (None: no caches)."""
    configs, inputs = {}, {}
    for name, (vocab, width, combiner) in TABLES.items():
        extra = {}
        if stores is not None and name in CACHES:
            extra = {"cache_rows": CACHES[name], "store": stores[name]}
        configs[name] = ks.TableConfig(vocab, DIM, combiner=combiner, **extra)
        inputs[name] = keras.Input((width,), dtype="int32", name=name)
    layer = ks.EmbeddingCollection(
        configs, optimizer=_optimizer(optimizer), name="features"
    )
    out = layer(inputs)
    flat = [keras.layers.Flatten()(out[n]) for n in TABLES]
    head = keras.layers.Dense(1, name="out")(keras.layers.Concatenate()(flat))
    model = keras.Model(inputs, head)
    model.compile(optimizer="sgd", loss="mse")
    return model, layer


def _state(layer):
    """Every saved entry of ``layer`` (whole tables: rows and slots)."""
    state = {}
    layer.save_own_variables(state)
    return {k: np.asarray(v) for k, v in state.items()}


def _stores(tmp_path):
    return {"a": ks.store.Host(), "b": ks.store.Disk(tmp_path / "rows")}


@pytest.mark.parametrize(
    "optimizer, staged",
    [("sgd", False), ("adagrad", False), ("adam", False), ("adagrad", True)],
)
def test_cached_tables_train_as_the_whole_tables(optimizer, staged, tmp_path):
    keras.utils.set_random_seed(3)
    full, plain = _model(optimizer)
    cached, layer = _model(optimizer, _stores(tmp_path))
    # The cached collection starts from the reference's tables (written
    # into its stores) and head.
    for name in TABLES:
        layer.set_table(name, plain.get_table(name))
        np.testing.assert_array_equal(layer.get_table(name), plain.get_table(name))
    cached.get_layer("out").set_weights(full.get_layer("out").get_weights())
    x, y = _batches(0)
    full.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    if staged:  # through the input stage: the caches map ids in the step
        cached.fit(ks.data.prefetch((x, y), cached, batch_size=BATCH), verbose=0)
    else:
        cached.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    for name in CACHES:
        stats = layer.stats(name)
        assert stats["evictions"] > 20 and stats["write_backs"] == stats["evictions"]
        assert stats["store_size"] == TABLES[name][0]
    got, want = _state(layer), _state(plain)
    assert sorted(got) == sorted(want) and len(want) >= 1 + len(TABLES)
    for key, value in want.items():
        assert got[key].shape == value.shape, key
        np.testing.assert_allclose(got[key], value, rtol=1e-6, atol=1e-6, err_msg=key)
    assert int(got["sparse_iterations"]) == STEPS
    # Inference reads the ids the caches do not hold from the stores.
    probe, _ = _batches(1, steps=2)
    np.testing.assert_allclose(
        cached.predict(probe, verbose=0), full.predict(probe, verbose=0),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip
    assert layer.stats("a")["store_hits"] > 0


def _asset_tables(path):
    """``{asset folder: rows}`` of the store rows a .keras file holds."""
    with zipfile.ZipFile(path) as zf:
        return {
            name.split("/")[-3]: json.loads(zf.read(name))["rows"]
            for name in zf.namelist()
            if name.endswith(f"{store_assets.FOLDER}/{chunk_files.MANIFEST}")
        }


def _collection_weights(path):
    """``{entry: array}`` of the collection's weights in a .keras file."""
    at = "layers/embedding_collection/vars/"
    entries = shared.weights_entries(path)
    return {k[len(at) :]: v for k, v in entries.items() if k.startswith(at)}


def test_save_and_load_continue_identically(tmp_path, monkeypatch):
    monkeypatch.setattr(store_assets, "CHUNK_BYTES", 8192)  # several chunks
    keras.utils.set_random_seed(4)
    stores = _stores(tmp_path)
    model, layer = _model("adam", stores)
    x, y = _batches(2)
    half = STEPS // 2 * BATCH
    first = {k: v[:half] for k, v in x.items()}
    second = {k: v[half:] for k, v in x.items()}
    model.fit(first, y[:half], batch_size=BATCH, shuffle=False, verbose=0)
    assert all(layer.stats(n)["size"] > 0 for n in CACHES)  # newer than stored
    path = tmp_path / "m.keras"
    model.save(path)
    before = _state(layer)
    # The cached tables (rows and slots) are in the assets, a folder each;
    # the weights hold no table-sized entry for them.
    assert _asset_tables(path) == {"cache_rows": 3000, "cache_rows_1": 2000}
    weights = _collection_weights(path)
    assert sorted(k for k in weights if k[0] in CACHES) == [
        "a:table_in_assets",
        "b:table_in_assets",
    ]
    assert max(np.size(v) for v in weights.values()) == 500 * DIM  # table "c"
    loaded = keras.models.load_model(path)
    again = loaded.get_layer("features")
    for name in CACHES:
        assert again.tables[name].cache_rows == CACHES[name]
        assert again.tables[name].store == stores[name]
        assert again.stats(name)["size"] == 0  # loaded into the store
    assert again.tables["c"].cache_rows is None
    for key, value in _state(again).items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)
    for m in (model, loaded):
        m.fit(second, y[half:], batch_size=BATCH, shuffle=False, verbose=0)
    want = _state(layer)
    for key, value in _state(again).items():
        np.testing.assert_allclose(value, want[key], rtol=1e-6, atol=1e-7)


def _trained(tmp_path, stores=None):
    keras.utils.set_random_seed(6)
    model, layer = _model("adagrad", stores or _stores(tmp_path))
    x, y = _batches(5, steps=4)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return model, layer


def test_files_with_the_tables_in_the_weights_still_load(tmp_path, monkeypatch):
    """Files of earlier versions: the whole tables in the collection's
    weights (the caches' asset files beside them, unread)."""
    model, layer = _trained(tmp_path)
    path = tmp_path / "old.keras"
    with monkeypatch.context() as m:  # the caches stream, the collection not
        old = types.SimpleNamespace(expected=lambda: False)
        m.setattr(collection_state, "store_assets", old)
        model.save(path)
    assert _collection_weights(path)["a:embeddings"].shape == (3000, DIM)
    assert _asset_tables(path) == {"cache_rows": 3000, "cache_rows_1": 2000}
    before = _state(layer)
    again = keras.saving.load_model(path).get_layer("features")
    for key, value in _state(again).items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)


def test_weights_files_keep_the_tables_and_keras_files_need_load_model(tmp_path):
    model, layer = _trained(tmp_path)
    want = _state(layer)
    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    with h5py.File(tmp_path / "m.weights.h5", "r") as f:  # in the weights
        assert f["layers/embedding_collection/vars/a:embeddings"].shape == (3000, DIM)
    hosts = {"a": ks.store.Host(), "b": ks.store.Host()}
    other, again = _model("adagrad", hosts)
    empty = _state(again)
    with pytest.raises(ValueError, match="asset files.*load_model") as info:
        other.load_weights(tmp_path / "m.keras")
    assert "Layer 'features'" in str(info.value)
    _, plain = _model("adagrad")  # no caches: cannot read a cached table's rows
    with pytest.raises(ValueError, match="table 'a': .* asset files.*`cache_rows`"):
        plain.load_own_variables({**want, "a:table_in_assets": np.int64(3000)})
    for key, value in _state(again).items():  # nothing changed
        np.testing.assert_array_equal(value, empty[key], err_msg=key)
    other.load_weights(tmp_path / "m.weights.h5")
    for key, value in _state(again).items():
        np.testing.assert_array_equal(value, want[key], err_msg=key)


def test_config_round_trips_the_store(tmp_path):
    spec = ks.store.Disk(tmp_path / "rows")
    config = ks.TableConfig(100, 4, cache_rows=64, store=spec).get_config()
    assert config["cache_rows"] == 64
    assert ks.store.get(config["store"]) == spec
    layer = ks.EmbeddingCollection(
        {"t": config, "u": ks.TableConfig(10, 4)}, optimizer="sgd", name="f"
    )
    again = ks.EmbeddingCollection.from_config(layer.get_config())
    assert again.tables["t"].cache_rows == 64 and again.tables["t"].store == spec
    assert again.tables["u"].cache_rows is None
    assert "cache_rows" not in again.tables["u"].get_config()
    assert list(again.table_caches) == ["t"]


_ONE_DEVICE = "`sharding`='row' is not available with `cache_rows` yet: use 'data'"


@pytest.mark.parametrize(
    "table, collection, match",
    [
        ({"store": "host"}, {}, "`store`='host' needs `cache_rows`"),
        ({"cache_rows": 101}, {}, r"`cache_rows` must be .* \[1, input_dim=100\]"),
        ({"cache_rows": 0}, {}, "`cache_rows` must be"),
        ({"cache_rows": 64, "store": "nowhere"}, {}, "`store`"),
        ({"cache_rows": 64, "sharding": "row"}, {}, _ONE_DEVICE),
        ({"cache_rows": 64}, {"sharding": "table"}, "collection's `sharding`="),
        ({"cache_rows": 64}, {"optimizer": None}, "needs a sparse `optimizer`"),
        (
            {"cache_rows": 64, "embeddings_initializer": "orthogonal"},
            {},
            "`embeddings_initializer`",
        ),
    ],
)
def test_refusals_name_the_collection_table_and_argument(table, collection, match):
    collection = {"optimizer": "sgd", **collection}
    spec = {"input_dim": 100, "output_dim": 4, **table}
    with pytest.raises(ValueError, match=match) as info:
        ks.EmbeddingCollection({"t": spec}, name="big", **collection)
    assert "Layer 'big', table 't'" in str(info.value)


def test_stats_needs_a_cached_table():
    layer = ks.EmbeddingCollection({"t": ks.TableConfig(10, 2)}, optimizer="sgd")
    with pytest.raises(ValueError, match="table 't' has none"):
        layer.stats("t")


def test_set_table_writes_the_store_and_empties_the_cache():
    layer = ks.EmbeddingCollection(
        {"t": ks.TableConfig(300, 3, cache_rows=64)}, optimizer="adagrad", name="f"
    )
    new = np.random.default_rng(0).normal(size=(300, 3)).astype("float32")
    layer.set_table("t", new)  # builds the layer: its store opens at build
    np.testing.assert_array_equal(layer.get_table("t"), new)
    layer({"t": np.array([5, 299])}, training=True)
    assert layer.stats("t")["size"] == 2
    before = layer.get_table("t")
    with pytest.raises(ValueError, match=r"table 't': `embeddings` must have shape"):
        layer.set_table("t", new[:10])
    np.testing.assert_array_equal(layer.get_table("t"), before)  # unchanged
    state = {}
    layer.save_own_variables(state)
    state["t:slot_accumulator"] = np.full((300, 3), 0.7, "float32")
    state["sparse_iterations"] = np.int32(9)
    layer.load_own_variables(state)
    assert layer.stats("t")["size"] == 0
    assert int(np.asarray(layer.table_caches["t"].sparse_iterations)) == 9
    layer({"t": np.array([5, 299])}, training=True)
    layer.set_table("t", new)  # the values only: the slots stay
    assert layer.stats("t")["size"] == 0
    out = layer({"t": np.array([5, 299])}, training=False)["t"]
    np.testing.assert_allclose(np.asarray(out), new[[5, 299]], rtol=1e-6)
    state = {}
    layer.save_own_variables(state)
    np.testing.assert_array_equal(state["t:slot_accumulator"], np.float32(0.7))
    np.testing.assert_array_equal(state["t:embeddings"], new)
