"""`EmbeddingCollection` tables in a served artifact take deltas.

``model.export`` gives each table an entry of ``keras_sparse_tables``; the
reference is ``model.predict`` of the trained model, served by a fresh
TensorFlow-only process (`tests.test_export._serve_fresh`), and NumPy row
writes into the stacked variable.
"""

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse.sharding import stacks
from tests.test_export import _serve_fresh
from tests.test_export import assert_refused

BACKEND = keras.backend.backend()
pytestmark = pytest.mark.skipif(
    BACKEND not in ("jax", "tensorflow"),
    reason="model.export(format='tf_saved_model') needs JAX or TensorFlow",
)
SIZES = {"user": 30, "item": 20, "tag": 10}


def _model(tables, col=None, **kwargs):
    if col is None:
        col = ks.EmbeddingCollection(tables, optimizer="adagrad", name="feat", **kwargs)
    inputs = {n: keras.Input((2,), dtype="int64", name=n) for n in tables}
    out = keras.layers.Concatenate()(list(col(inputs).values()))
    model = keras.Model(
        list(inputs.values()), keras.layers.Dense(1, trainable=False)(out)
    )
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model, col


def _ids(rng, n, high=None):
    return [rng.integers(0, high or v, (n, 2)).astype(np.int64) for v in SIZES.values()]


def test_served_collection_tables_apply_a_delta_without_a_new_export(
    tmp_path, monkeypatch
):
    """Export at step s, train on, apply ``export(since_step=s)`` to the
    artifact: it serves like `predict`; "user" and "item" share one stack,
    so the item rows land at their offset in it; "tag" has bfloat16 rows."""
    monkeypatch.setattr(stacks, "PER_TABLE_STACKS_ON_CPU", False)
    tables = {n: ks.TableConfig(v, 4, combiner="sum") for n, v in SIZES.items()}
    # A stack of its own, 16-bit rows.
    tables["tag"] = ks.TableConfig(10, 8, combiner="mean", table_dtype="bfloat16")
    model, col = _model(tables, track_changes=True)
    assert col._stack_of("item") is col._stack_of("user")
    assert col._stack_of("item").offsets["item"] == 30
    rng = np.random.default_rng(0)
    y = rng.normal(size=(96, 1)).astype("float32")
    model.fit(_ids(rng, 32), y[:32], batch_size=16, verbose=0)
    model.export(tmp_path / "model", format="tf_saved_model", verbose=False)
    since = int(col.export(since_step=-1)["item"]["step"])
    model.fit(_ids(rng, 64, high=8), y[32:], batch_size=16, verbose=0)
    deltas = col.export(since_step=since)
    assert all(0 < len(d["keys"]) <= 8 for d in deltas.values())
    probe = [np.arange(20, dtype=np.int64).reshape(10, 2) % v for v in SIZES.values()]
    expected = model.predict(probe, verbose=0)
    served = _serve_fresh(tmp_path, tmp_path / "model", probe, deltas)
    np.testing.assert_allclose(served, expected, atol=1e-6, rtol=0)

    import tensorflow as tf

    root = tf.saved_model.load(str(tmp_path / "model"))  # keeps the variables
    stale = np.asarray(root.serve(probe))
    assert np.abs(stale - expected).max() > 1e-3  # the deltas matter
    loaded = root.keras_sparse_tables
    stack = loaded["item"].embeddings
    assert stack is loaded["user"].embeddings and stack.shape[0] == 50
    want = stack.numpy()
    rows = np.full((2, 4), 7.0, np.float32)
    loaded["item"].update(np.array([1, 19], np.int64), rows)
    want[[31, 49]] = rows  # NumPy: the item rows of the stack
    np.testing.assert_array_equal(stack.numpy(), want)
    # TensorFlow's messages escape the quotes.
    assert_refused(
        loaded["item"],
        [
            (
                [3, 20],
                [],
                r"feat.{1,3} table .{1,3}item.{1,3}: keys are row ids in \[0, 20\)",
            ),
            ([-1], [], r"item.{1,3}: keys are row ids"),
            ([3], [7], "item.{1,3}: a fixed vocabulary removes no rows"),
        ],
    )


@pytest.mark.parametrize("kind", ["quantized", "cache_rows"])
def test_served_collection_tables_without_deltas_say_so(tmp_path, kind):
    if kind == "cache_rows" and BACKEND == "jax":
        pytest.skip("a JAX model with a row cache does not export")
    cached = {"cache_rows": 16} if kind == "cache_rows" else {}
    tables = {
        "user": ks.TableConfig(30, 4, combiner="sum", **cached),
        "item": ks.TableConfig(20, 4, combiner="sum"),
    }
    model, col = _model(tables)
    rng = np.random.default_rng(1)
    model.fit(_ids(rng, 8)[:2], np.ones((8, 1)), verbose=0)
    if kind == "quantized":
        model.quantize("int8")
    model.export(tmp_path / "model", format="tf_saved_model", verbose=False)

    import tensorflow as tf

    root = tf.saved_model.load(str(tmp_path / "model"))
    loaded = root.keras_sparse_tables
    refused = ["user", "item"] if kind == "quantized" else ["user"]
    reason = "quantized" if kind == "quantized" else "`cache_rows`"
    for name in refused:
        match = f"feat.{{1,3}} table .{{1,3}}{name}.*takes no delta.*{reason}"
        with pytest.raises(tf.errors.InvalidArgumentError, match=match):
            loaded[name].update(np.array([1], np.int64), np.ones((1, 4), np.float32))
    if kind == "cache_rows":
        loaded["item"].update(np.array([1], np.int64), np.ones((1, 4), np.float32))


def test_a_table_named_like_another_entry_is_refused_at_export(tmp_path):
    ids = keras.Input((2,), dtype="int64")
    col = ks.EmbeddingCollection(
        {"items": ks.TableConfig(20, 4, combiner="sum")}, optimizer="sgd"
    )
    dense = ks.AllToAllDenseEmbedding(20, 4, combiner="sum", name="items")
    out = keras.layers.Concatenate()([col({"items": ids})["items"], dense(ids)])
    model = keras.Model(ids, out)
    with pytest.raises(ValueError, match="table 'items'.*entry 'items' is taken"):
        model.export(tmp_path / "model", format="tf_saved_model", verbose=False)


@pytest.mark.skipif(BACKEND != "jax", reason="sharding is implemented for JAX")
def test_sharded_collection_tables_apply_a_delta(tmp_path):
    """Table-wise tables (each in its device's block of the stack) and a
    row-sharded one, exported as one artifact, take their deltas."""
    from keras_sparse import sharding

    tables = {
        "user": ks.TableConfig(30, 4, combiner="sum", sharding="table"),
        "item": ks.TableConfig(20, 4, combiner="sum", sharding="table"),
        "tag": ks.TableConfig(10, 4, combiner="sum", sharding="row"),
    }
    previous = keras.distribution.distribution()
    rng = np.random.default_rng(2)
    y = rng.normal(size=(64, 1)).astype("float32")
    try:
        col = ks.EmbeddingCollection(
            tables, optimizer="adagrad", track_changes=True, name="feat"
        )
        keras.distribution.set_distribution(sharding.distribution([col], devices=8))
        model, _ = _model(tables, col)  # built under the mesh
        assert col._stack_of("item").offsets["item"] > 0  # a device's block
        model.fit(_ids(rng, 32), y[:32], batch_size=16, verbose=0)
        model.export(tmp_path / "model", format="tf_saved_model", verbose=False)
        since = int(col.export(since_step=-1)["item"]["step"])
        model.fit(_ids(rng, 32, high=8), y[32:], batch_size=16, verbose=0)
        deltas = col.export(since_step=since)
        assert all(len(d["keys"]) for d in deltas.values())
        probe = [
            np.arange(32, dtype=np.int64).reshape(16, 2) % v for v in SIZES.values()
        ]
        expected = model.predict(probe, verbose=0)
    finally:
        keras.distribution.set_distribution(previous)
    served = _serve_fresh(tmp_path, tmp_path / "model", probe, deltas)
    np.testing.assert_allclose(served, expected, atol=1e-6, rtol=0)
