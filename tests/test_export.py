"""``model.export`` of keras-sparse models, served by a fresh process.

The serving process imports TensorFlow only (it asserts that keras_sparse is
not loaded), loads the SavedModel and runs it; the reference is
``model.predict`` of the trained model in this process (which, on JAX
without x64, maps the full int64 keys on the host).
"""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import keras_sparse as ks
from tests.helpers import docs_code

BACKEND = keras.backend.backend()
pytestmark = pytest.mark.skipif(
    BACKEND not in ("jax", "tensorflow"),
    reason="model.export(format='tf_saved_model') needs JAX or TensorFlow",
)

_SERVE = textwrap.dedent(
    """
    import sys
    import numpy as np
    import tensorflow as tf

    path, data, out, records = sys.argv[1:5]
    served = tf.saved_model.load(path)
    if records != "-":
        saved = np.load(records)
        names = sorted({k.split("/")[0] for k in saved.files})
        for name in names:
            table, rec = served.keras_sparse_tables[name], name + "/"
            values = saved[rec + "values"]
            if values.dtype.kind == "V":  # bfloat16 rows: np.savez keeps bytes
                dtype = tf.as_dtype(str(saved[rec + "dtype"]))
                values = values.view(dtype.as_numpy_dtype)
            if rec + "removed_keys" in saved.files:  # a delta
                table.apply_delta(
                    saved[rec + "keys"], values, saved[rec + "removed_keys"]
                )
            else:
                table.update(saved[rec + "keys"], values)
    arrays = np.load(data)
    inputs = [arrays["x%d" % i] for i in range(len(arrays.files))]
    np.save(out, np.asarray(served.serve(inputs if len(inputs) > 1 else inputs[0])))
    assert "keras_sparse" not in sys.modules
    """
)

SERVING_PAGE = "docs/guides/serving.md"


def _serve_fresh(tmp_path, artifact, inputs, records=None):
    """Outputs of the artifact for ``inputs`` in a new TensorFlow-only
    process, after applying ``records`` ({layer name: layer.export()})."""
    data, out = tmp_path / "inputs.npz", tmp_path / "served.npy"
    np.savez(data, **{f"x{i}": x for i, x in enumerate(inputs)})
    saved = "-"
    if records:
        saved = tmp_path / "records.npz"
        arrays = {}
        for name, rec in records.items():
            arrays[f"{name}/keys"] = rec["keys"]
            arrays[f"{name}/values"] = rec["values"]
            for field in ("removed_keys", "dtype"):  # a delta's
                if field in rec:
                    arrays[f"{name}/{field}"] = rec[field]
        np.savez(saved, **arrays)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("KERAS_BACKEND", None)
    done = subprocess.run(
        [sys.executable, "-c", _SERVE, str(artifact), str(data), str(out), str(saved)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return np.load(out)


def _data(n, seed, vocab=200, unknown=False):
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, vocab, size=(n, 3)).astype(np.int64) * 7_919_993_123
    keys -= 3 << 40  # beyond int32, negative ones too
    if unknown:
        keys[::3, 0] += 1  # never trained
    w = rng.uniform(0.5, 2.0, size=(n, 3)).astype("float32")
    w[::4, 1] = 0.0  # padding
    tokens = rng.integers(0, 50, size=(n, 2)).astype(np.int64)
    return [keys, w, tokens], rng.normal(size=(n, 1)).astype("float32")


def _layers(hash_sharding="auto", fixed_sharding="auto"):
    hashed = ks.DistributedHashEmbedding(
        8,
        capacity=512,
        combiner="mean",
        optimizer="adagrad",
        sharding=hash_sharding,
        name="hashed",
    )
    if fixed_sharding == "table":  # table-wise: tables of a collection
        tables = {
            n: ks.TableConfig(56, 8, combiner="sum", sharding="table") for n in "ab"
        }
        return hashed, ks.EmbeddingCollection(tables, optimizer="adagrad", name="fixed")
    fixed = ks.AllToAllDenseEmbedding(
        56,
        8,
        combiner="sum",
        optimizer="adagrad",
        sharding=fixed_sharding,
        name="fixed",
    )
    return hashed, fixed


def _model(layers=None):
    hashed, fixed = layers or _layers()
    keys = keras.Input((3,), dtype="int64", name="keys")
    w = keras.Input((3,), dtype="float32", name="w")
    tokens = keras.Input((2,), dtype="int64", name="tokens")
    if isinstance(fixed, ks.EmbeddingCollection):
        looked_up = list(fixed({"a": tokens, "b": tokens}).values())
    else:
        looked_up = [fixed(tokens)]
    both = keras.layers.Concatenate()([hashed(keys, weights=w)] + looked_up)
    out = keras.layers.Dense(1)(keras.layers.Dense(16, activation="relu")(both))
    model = keras.Model([keys, w, tokens], out)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def test_export_serves_like_predict_in_a_fresh_process(tmp_path):
    model = _model()
    x, y = _data(256, seed=0)
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    model.export(tmp_path / "model", format="tf_saved_model", verbose=False)
    probe, _ = _data(97, seed=1, unknown=True)  # an odd batch size
    expected = model.predict(probe, batch_size=97, verbose=0)
    served = _serve_fresh(tmp_path, tmp_path / "model", probe)
    assert np.abs(expected).max() > 0
    np.testing.assert_allclose(served, expected, atol=1e-6, rtol=0)


def _hash_only_model(dim, key_shape, key_dtype, **kwargs):
    """keys, weights -> one summed hash embedding (its output unchanged)."""
    keys = keras.Input(key_shape, dtype=key_dtype, name="keys")
    w = keras.Input(key_shape, dtype="float32", name="w")
    layer = ks.DistributedHashEmbedding(
        dim, capacity=128, combiner="sum", optimizer="adagrad", name="hashed", **kwargs
    )
    model = keras.Model([keys, w], layer(keys, weights=w))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model, layer


def test_served_tables_take_retrained_records_without_a_new_export(tmp_path):
    """`update` of the artifact's table: new keys, evicted keys, new rows."""
    model, layer = _hash_only_model(8, (3,), "int64")
    (k, w_, _), _ = _data(256, seed=0, vocab=100)
    y = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
    model.fit([k[:128], w_[:128]], y[:128], batch_size=32, verbose=0)
    model.export(tmp_path / "model", format="tf_saved_model", verbose=False)
    # Retrain on other keys: the 128-row table evicts, rows change hands.
    (k2, w2, _), _ = _data(256, seed=5, vocab=400)
    model.fit([k2, w2], y, batch_size=32, verbose=0)
    assert layer.stats()["evictions"] > 0
    probe = [np.concatenate([k[:40], k2[:40]]), np.concatenate([w_[:40], w2[:40]])]
    expected = model.predict(probe, verbose=0)
    stale = _serve_fresh(tmp_path, tmp_path / "model", probe)
    assert np.abs(stale - expected).max() > 1e-3  # the export is out of date
    served = _serve_fresh(
        tmp_path, tmp_path / "model", probe, records={"hashed": layer.export()}
    )
    np.testing.assert_allclose(served, expected, atol=1e-6, rtol=0)


def test_served_tables_apply_a_delta_without_a_new_export(tmp_path):
    """`apply_delta` of the artifact's table: the delta since the export
    (new keys, evicted ones, changed vectors) serves like `predict`."""
    model, layer = _hash_only_model(8, (3,), "int64", track_changes=True)
    (k, w_, _), _ = _data(128, seed=0, vocab=100)
    y = np.random.default_rng(0).normal(size=(128, 8)).astype("float32")
    model.fit([k[:64], w_[:64]], y[:64], batch_size=32, verbose=0)
    model.export(tmp_path / "model", format="tf_saved_model", verbose=False)
    since = int(layer.export(since_step=-1)["step"])
    (k2, w2, _), _ = _data(128, seed=5, vocab=400)
    model.fit([k2[:32], w2[:32]], y[:32], batch_size=32, verbose=0)
    delta = layer.export(since_step=since)
    assert len(delta["removed_keys"]) > 0  # the 128-row table evicted
    assert len(delta["keys"]) < len(layer.export()["keys"])
    probe = [np.concatenate([k[:40], k2[:40]]), np.concatenate([w_[:40], w2[:40]])]
    expected = model.predict(probe, verbose=0)
    served = _serve_fresh(
        tmp_path, tmp_path / "model", probe, records={"hashed": delta}
    )
    np.testing.assert_allclose(served, expected, atol=1e-6, rtol=0)


def test_served_fixed_tables_apply_a_delta_without_a_new_export(tmp_path):
    """An `AllToAllDenseEmbedding` with ``track_changes=True`` in a served
    artifact: the delta since the export (``export(since_step=s)``, the
    rows trained after it) installs by ``apply_delta`` and serves like
    `predict`; bad rows are refused before anything is written."""
    ids = keras.Input((2,), dtype="int64", name="ids")
    table = ks.AllToAllDenseEmbedding(
        50, 4, combiner="sum", optimizer="adagrad", track_changes=True, name="items"
    )
    out = keras.layers.Dense(1, trainable=False)(table(ids))
    model = keras.Model(ids, out)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, (96, 2)).astype(np.int64)
    y = rng.normal(size=(96, 1)).astype("float32")
    model.fit(x[:32], y[:32], batch_size=16, verbose=0)
    model.export(tmp_path / "model", format="tf_saved_model", verbose=False)
    since = int(table.export(since_step=-1)["step"])
    x2 = rng.integers(0, 20, (64, 2)).astype(np.int64)  # rows 0..19 change
    model.fit(x2, y[32:], batch_size=16, verbose=0)
    delta = table.export(since_step=since)
    assert 0 < len(delta["keys"]) < 50
    probe = [np.arange(50, dtype=np.int64).reshape(25, 2)]
    expected = model.predict(probe, verbose=0)
    stale = _serve_fresh(tmp_path, tmp_path / "model", probe)
    assert np.abs(stale - expected).max() > 1e-3  # the delta matters
    served = _serve_fresh(tmp_path, tmp_path / "model", probe, {"items": delta})
    np.testing.assert_allclose(served, expected, atol=1e-6, rtol=0)

    import tensorflow as tf

    root = tf.saved_model.load(str(tmp_path / "model"))  # keeps the variables
    assert_refused(
        root.keras_sparse_tables["items"],
        [([3, 50], [], r"row ids in \[0, 50\)"), ([3], [7], "removes no rows")],
    )


def assert_refused(entry, cases):
    """Each ``(keys, removed_keys, match)`` of ``cases`` given to
    ``entry.apply_delta`` raises, and the served rows stay as they were."""
    import tensorflow as tf

    before = entry.embeddings.numpy()
    for keys, removed, match in cases:
        with pytest.raises(tf.errors.InvalidArgumentError, match=match):
            entry.apply_delta(
                np.array(keys, np.int64),
                np.ones((len(keys), before.shape[1]), before.dtype),
                np.array(removed, np.int64),
            )
    np.testing.assert_array_equal(entry.embeddings.numpy(), before)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="string tensors: TensorFlow")
def test_string_keys_are_hashed_inside_the_exported_graph(tmp_path):
    import tensorflow as tf

    model, _ = _hash_only_model(4, (2,), "string")
    rng = np.random.default_rng(0)
    words = np.array([f"user_{i}_é" for i in range(40)], dtype=object)
    x = [words[rng.integers(0, 40, size=(64, 2))], np.ones((64, 2), "float32")]
    data = tf.data.Dataset.from_tensor_slices((tuple(x), rng.normal(size=(64, 4))))
    model.fit(data.batch(16), verbose=0)
    model.export(tmp_path / "model", format="tf_saved_model", verbose=False)
    probe = [np.array([["user_3_é", "never_seen"], ["user_7_é", "user_3_é"]]), x[1][:2]]
    expected = model.predict([tf.constant(probe[0]), probe[1]], verbose=0)
    served = _serve_fresh(tmp_path, tmp_path / "model", probe)
    assert np.abs(expected[1]).max() > 0
    np.testing.assert_allclose(served, expected, atol=1e-6, rtol=0)


@pytest.mark.skipif(BACKEND != "jax", reason="sharding is implemented for JAX")
@pytest.mark.parametrize(
    "hash_sharding, fixed_sharding",
    [("key", "row"), ("row", "column"), ("data", "table")],
)
def test_sharded_models_export_as_one_artifact(tmp_path, hash_sharding, fixed_sharding):
    from keras_sparse import sharding

    x, y = _data(256, seed=0)
    layers = _layers(hash_sharding, fixed_sharding)
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(sharding.distribution(layers, devices=8))
    try:
        model = _model(layers)  # built under the mesh
        assert model.get_layer("hashed")._ks_strategy == hash_sharding
        model.fit(x, y, batch_size=32, epochs=2, verbose=0)
        probe, _ = _data(64, seed=1, unknown=True)
        expected = model.predict(probe, batch_size=32, verbose=0)
        model.export(tmp_path / "model", format="tf_saved_model", verbose=False)
    finally:
        keras.distribution.set_distribution(previous)
    served = _serve_fresh(tmp_path, tmp_path / "model", probe)
    assert np.abs(expected).max() > 0
    np.testing.assert_allclose(served, expected, atol=1e-5, rtol=0)


def test_onnx_export_names_what_is_missing(tmp_path):
    model = _model()
    model(_data(4, seed=0)[0])  # export needs a called model
    missing = {"tensorflow": "tf2onnx", "jax": "jax2onnx"}[BACKEND]
    try:
        __import__(missing)
        __import__("onnx")
    except ImportError:
        pass
    else:
        pytest.skip(f"{missing} is installed")
    with pytest.raises(ImportError, match="onnx"):
        model.export(tmp_path / "model.onnx", format="onnx", verbose=False)


def test_docs_serving_example_serves_the_updated_tables():
    """The serving guide's example: export, retrain, hot update, serve."""
    scope = {}
    code = docs_code(SERVING_PAGE, "# Serving: `model.export`")
    exec(compile(code, SERVING_PAGE, "exec"), scope)
    served = scope["served"]
    assert served.returncode == 0, served.stderr[-3000:]
    x, model = scope["x"], scope["model"]
    expected = model.predict([x[0][:1], x[1][:1]], verbose=0)
    assert abs(float(expected[0, 0])) > 0
    got = float(served.stdout.strip().strip("[]"))
    np.testing.assert_allclose(got, expected[0, 0], rtol=1e-5, atol=1e-6)
