"""EmbeddingCollection on one device: equals separate AllToAllDenseEmbedding
layers (forward and training), saves per table, rejects bad input (every
backend)."""

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse.sharding import keras_integration
from keras_sparse.sharding import stacks
from tests.helpers import fit_losses

BATCH, STEPS = 16, 5
# Two tables of width 8 share a stack; "c" (width 4) gets its own.
TABLES = {
    "a": dict(input_dim=50, output_dim=8, combiner="sum"),
    "b": dict(input_dim=30, output_dim=8),
    "c": dict(input_dim=20, output_dim=4, combiner="mean"),
}
SHAPES = {"a": (3,), "b": (), "c": (2,)}


def _collection(optimizer, name="features"):
    return ks.EmbeddingCollection(
        {n: ks.TableConfig(**cfg) for n, cfg in TABLES.items()},
        optimizer=optimizer,
        name=name,
    )


def _separate(optimizer):
    return {
        n: ks.AllToAllDenseEmbedding(
            cfg["input_dim"],
            cfg["output_dim"],
            combiner=cfg.get("combiner"),
            optimizer=optimizer,
            name=f"emb_{n}",
        )
        for n, cfg in TABLES.items()
    }


def _inputs():
    return {n: keras.Input(SHAPES[n], dtype="int32", name=n) for n in TABLES}


def _head(outputs):
    flat = [keras.layers.Flatten()(outputs[n]) for n in TABLES]
    h = keras.layers.Concatenate()(flat)
    return keras.layers.Dense(1, name="head")(h)


def _models(optimizer):
    inputs = _inputs()
    coll = _collection(optimizer)
    model = keras.Model(inputs, _head(coll(inputs)))
    layers = _separate(optimizer)
    inputs = _inputs()
    ref = keras.Model(inputs, _head({n: layers[n](inputs[n]) for n in TABLES}))
    # Same starting point: the reference takes the collection's tables.
    for n in TABLES:
        layers[n].embeddings.assign(coll.get_table(n))
    ref.get_layer("head").set_weights(model.get_layer("head").get_weights())
    for m in (model, ref):
        m.compile(keras.optimizers.Adam(0.01), "mse")
    return model, coll, ref, layers


def _data(seed=0):
    rng = np.random.default_rng(seed)
    n = BATCH * STEPS
    x = {
        name: rng.integers(0, cfg["input_dim"], size=(n,) + SHAPES[name]).astype(
            "int32"
        )
        for name, cfg in TABLES.items()
    }
    x["a"][:, 0] = 7  # a hot row: duplicates every step
    return x, rng.normal(size=(n, 1)).astype("float32")


def _fit(model, x, y):
    return fit_losses(model, x, y, BATCH)


@pytest.mark.parametrize("optimizer", ["adam", "adagrad", None])
def test_matches_separate_layers(optimizer):
    model, coll, ref, layers = _models(optimizer)
    x, y = _data()
    probe = {n: v[:BATCH] for n, v in x.items()}
    np.testing.assert_array_equal(
        model.predict(probe, verbose=0), ref.predict(probe, verbose=0)
    )
    np.testing.assert_array_equal(_fit(model, x, y), _fit(ref, x, y))
    for n in TABLES:
        np.testing.assert_array_equal(coll.get_table(n), layers[n].embeddings.numpy())
    if optimizer is not None:
        assert int(coll.sparse_iterations.numpy()) == STEPS
        assert int(layers["a"].sparse_iterations.numpy()) == STEPS
    if keras_integration.per_table_stacks():  # JAX or TensorFlow on a CPU
        assert [s.tables for s in coll.stacks] == [(n,) for n in TABLES]
    else:  # two widths -> two stacks, each looked up once per call
        assert [s.name for s in coll.stacks] == ["stack_8_data", "stack_4_data"]
        assert coll.stacks[0].offsets == {"a": 0, "b": 50}


@pytest.mark.skipif(
    keras.backend.backend() == "torch", reason="torch keeps a stack per width"
)
def test_one_stack_per_table_trains_like_one_stack_per_width(monkeypatch):
    """The CPU layout (a stack per table, `per_table_stacks`) and the
    accelerator layout (a stack per width) train bit for bit alike."""
    x, y = _data()
    results = []
    for per_table in (False, True):
        monkeypatch.setattr(stacks, "PER_TABLE_STACKS_ON_CPU", per_table)
        keras.utils.set_random_seed(0)
        inputs = _inputs()
        coll = _collection("adagrad")
        model = keras.Model(inputs, _head(coll(inputs)))
        model.compile(keras.optimizers.Adam(0.01), "mse")
        losses = _fit(model, x, y)
        assert len(coll.stacks) == (len(TABLES) if per_table else 2)
        results.append((losses, [coll.get_table(n) for n in TABLES]))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_array_equal(a, b)


def test_eager_outputs_and_weights_match():
    coll = _collection("adagrad")
    layers = _separate("adagrad")
    rng = np.random.default_rng(1)
    ids = {
        n: rng.integers(0, c["input_dim"], (4,) + SHAPES[n]) for n, c in TABLES.items()
    }
    weights = {"a": rng.uniform(size=(4, 3)).astype("float32")}
    weights["a"][0, 1] = 0.0  # padding
    out = coll(ids, weights=weights)
    assert list(out) == list(TABLES)
    for n in TABLES:
        layers[n].build()
        layers[n].embeddings.assign(coll.get_table(n))
        want = layers[n](ids[n], weights=weights.get(n))
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(out[n]), keras.ops.convert_to_numpy(want)
        )


def test_save_load_per_table(tmp_path):
    model, coll, _, _ = _models("adam")
    x, y = _data()
    _fit(model, x, y)
    path = str(tmp_path / "coll.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    got = loaded.get_layer("features")
    assert got.get_config() == coll.get_config()
    # Weights: the dedup scratch (step state, never saved) is not one.
    assert len(got.weights) == len(coll.weights)
    for a, b in zip(coll.weights, got.weights):
        assert a.path == b.path
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # Training resumes identically.
    x2, y2 = _data(1)
    np.testing.assert_allclose(_fit(loaded, x2, y2), _fit(model, x2, y2), rtol=1e-6)


def test_config_round_trip_and_plain_dicts():
    coll = ks.EmbeddingCollection(TABLES, optimizer="sgd", name="c")
    again = ks.EmbeddingCollection.from_config(coll.get_config())
    assert again.get_config() == coll.get_config()
    assert again.tables["c"].combiner == "mean"


def test_bad_inputs_name_layer_and_table():
    coll = _collection("adagrad")
    ids = {n: np.zeros((2,) + SHAPES[n], "int32") for n in TABLES}
    coll(ids)
    with pytest.raises(ValueError, match=r"'features'.*unknown table.*\['d'\]"):
        coll({**ids, "d": ids["a"]})
    with pytest.raises(ValueError, match=r"'features'.*no ids for table.*\['b'\]"):
        coll({n: v for n, v in ids.items() if n != "b"})
    bad = dict(ids, c=np.array([[1, 20], [0, 0]]))
    with pytest.raises(ValueError, match=r"'features' table 'c'.*id 20.*\[0, 20\)"):
        coll(bad)
    with pytest.raises(TypeError, match=r"'features' table 'a'.*integer"):
        coll(dict(ids, a=ids["a"].astype("float32")))
    with pytest.raises(TypeError, match="dict of table name"):
        coll(ids["a"])
    with pytest.raises(ValueError, match=r"table 'x'.*output_dim"):
        ks.EmbeddingCollection({"x": {"input_dim": 3, "output_dim": 0}}, name="e")
    with pytest.raises(ValueError, match="table names"):
        ks.EmbeddingCollection({"x/y": ks.TableConfig(3, 2)})
    with pytest.raises(ValueError, match="non-empty dict"):
        ks.EmbeddingCollection({})


def test_checkpoint_missing_an_entry_is_refused_and_changes_nothing():
    tables = {"a": ks.TableConfig(10, 2), "b": ks.TableConfig(6, 2)}
    plain = ks.EmbeddingCollection(tables, name="features")
    plain.build()
    store = {}
    plain.save_own_variables(store)
    sparse = ks.EmbeddingCollection(tables, optimizer="adagrad", name="features")
    sparse.build()
    before = [np.array(keras.ops.convert_to_numpy(v)) for v in sparse.weights]
    with pytest.raises(ValueError, match=r"features.*no \[.*'a:slot_accumulator'"):
        sparse.load_own_variables(store)
    full = {}
    sparse.save_own_variables(full)
    bad = dict(full, **{"b:embeddings": np.zeros((5, 2), "float32")})
    with pytest.raises(ValueError, match=r"table 'b'.*shape \(6, 2\)"):
        sparse.load_own_variables(bad)
    for old, new in zip(before, sparse.weights, strict=True):
        np.testing.assert_array_equal(old, keras.ops.convert_to_numpy(new))


@pytest.mark.parametrize("optimizer", [None, "adagrad"])
def test_each_table_starts_with_what_its_own_initializer_draws(optimizer):
    # Stacks are drawn table by table (into one buffer on torch, into the
    # variable on TensorFlow, joined on JAX): each table's rows must still
    # be its initializer's draw, and its optimizer slot its initial value.
    inits = {n: keras.initializers.RandomUniform(-1, 1, seed=i) for i, n in
             enumerate(TABLES)}  # fmt: skip
    collection = ks.EmbeddingCollection(
        {n: ks.TableConfig(**cfg, embeddings_initializer=inits[n])
         for n, cfg in TABLES.items()},
        optimizer=optimizer,
    )  # fmt: skip
    collection.build({n: (None,) + SHAPES[n] for n in TABLES})
    for name, cfg in TABLES.items():
        expected = inits[name]((cfg["input_dim"], cfg["output_dim"]))
        np.testing.assert_array_equal(
            collection.get_table(name), keras.ops.convert_to_numpy(expected)
        )
    if optimizer is not None:
        for slots in collection._stack_slots.values():
            for slot in slots.values():
                np.testing.assert_array_equal(slot.numpy(), np.float32(0.1))
