"""int8/int4 serving tables (`quantize`) of the three table kinds.

References: Keras's own quantized `keras.layers.Embedding` holding the same
float table (same variables, same lookups) and a NumPy dequantization.
"""

import keras
import numpy as np
import pytest

import keras_sparse as ks

BACKEND = keras.backend.backend()


def _numpy_rows(arrays, dim):
    """Float rows of Keras's quantized arrays, in NumPy (int4: Keras packs
    two values a byte, the first in the low nibble)."""
    q = np.asarray(arrays["embeddings"]).astype(np.int16)
    if q.shape[1] != dim:
        low, high = ((q & 15) ^ 8) - 8, (((q >> 4) & 15) ^ 8) - 8
        q = np.stack([low, high], -1).reshape(len(q), -1)[:, :dim]
    scale = np.asarray(arrays["embeddings_scale"], np.float32)
    if "embeddings_zero" not in arrays:
        return q / scale[:, None]
    groups = np.asarray(arrays["g_idx"]).astype(int)
    zero = np.asarray(arrays["embeddings_zero"]).astype(np.float32)
    return (q - zero[:, groups]) * scale[:, groups]


def _keras_quantized(table, mode):
    ref = keras.layers.Embedding(*table.shape)
    ref.build()
    ref.embeddings.assign(table)
    ref.quantize(mode)
    return ref


def _keras_arrays(ref):
    names = ["embeddings_scale", "embeddings_zero", "g_idx"]
    out = {"embeddings": np.asarray(ref._embeddings)}
    out.update({n: np.asarray(getattr(ref, n)) for n in names if hasattr(ref, n)})
    return out


def _values(variables):
    return {v.path.rsplit("/", 1)[-1]: np.asarray(v) for v in variables}


@pytest.mark.parametrize("mode", ["int8"])  # int4: the collection's test
def test_dense_sparse_optimizer_table_quantizes_as_keras(mode):
    rng = np.random.default_rng(0)
    table = rng.normal(size=(40, 10)).astype("float32")
    inp = keras.Input((3,), dtype="int32")
    layer = ks.AllToAllDenseEmbedding(40, 10, optimizer="adagrad", combiner="mean")
    model = keras.Model(inp, layer(inp))
    layer.embeddings.assign(table)
    model.quantize(mode)
    assert layer.dtype_policy.quantization_mode == mode
    ref = _keras_quantized(table, mode)
    got = _values(layer.variables)  # slots and step counter are gone
    want = _keras_arrays(ref)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    ids = np.array([[1, 2, 39], [0, 0, 7]])
    expected = _numpy_rows(want, 10)[ids].mean(axis=1)
    out = np.asarray(model(ids))
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        out, np.asarray(ref(ids)).mean(axis=1), rtol=1e-6, atol=1e-6
    )
    with pytest.raises(ValueError, match=f"'{layer.name}'.*quantized"):
        layer(ids, training=True)


def test_collection_tables_quantize_as_keras_and_save_exactly(tmp_path):
    mode = "int4"  # grouped (Keras's default config): the most arrays
    rng = np.random.default_rng(1)
    tables = {
        "a": rng.normal(size=(30, 8)).astype("float32"),
        "b": rng.normal(size=(20, 8)).astype("float32"),
        "c": rng.normal(size=(10, 6)).astype("float32"),
    }
    configs = {
        "a": ks.TableConfig(30, 8, combiner="sum"),
        "b": ks.TableConfig(20, 8),
        "c": ks.TableConfig(10, 6),
    }
    x = {"a": np.array([[1, 2], [3, 29]]), "b": np.array([0, 19])}
    x["c"] = np.array([9, 4])
    inputs = {k: keras.Input(v.shape[1:], dtype="int32", name=k) for k, v in x.items()}
    col = ks.EmbeddingCollection(configs, optimizer="adagrad", name="features")
    model = keras.Model(inputs, col(inputs))
    for name, value in tables.items():
        col.set_table(name, value)
    model.quantize(mode)
    out = model(x)
    for name, value in tables.items():
        ref = _keras_quantized(value, mode)
        expected = np.asarray(ref(x[name]))
        if name == "a":
            expected = expected.sum(axis=1)
        np.testing.assert_allclose(out[name], expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(
            col.get_table(name), _numpy_rows(_keras_arrays(ref), value.shape[1]),
            rtol=1e-6, atol=1e-7,
        )  # fmt: skip
    with pytest.raises(ValueError, match="'features'.*quantized"):
        col(x, training=True)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    twin = loaded.get_layer("features")
    assert twin.dtype_policy.name == col.dtype_policy.name
    for a, b in zip(col.variables, twin.variables, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for name, value in loaded(x).items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(out[name]))


def test_hash_table_quantizes_keeping_keys_and_saves_exactly(tmp_path):
    mode = "int8"
    keys = np.array([[5, 10**12], [7, 5], [99, 3]], dtype="int64")
    inp = keras.Input((2,), dtype="int64")
    layer = ks.DistributedHashEmbedding(
        8, capacity=64, combiner="sum", optimizer="adagrad", name="ids"
    )
    model = keras.Model(inp, layer(inp))
    layer(keys, training=True)  # five keys get rows
    table = np.asarray(layer.embeddings)
    rows_before = layer.table.lookup(np.array([5, 7, 99, 3, 10**12]))
    model.quantize(mode)
    assert layer.stats()["size"] == 5
    np.testing.assert_array_equal(
        layer.table.lookup(np.array([5, 7, 99, 3, 10**12])), rows_before
    )
    want = _keras_arrays(_keras_quantized(table, mode))
    for name, variable in layer.quantized_rows.items():
        np.testing.assert_array_equal(np.asarray(variable), want[name], err_msg=name)
    flat = _numpy_rows(want, 8)
    rows = np.asarray(rows_before).reshape(-1)
    by_key = dict(zip([5, 7, 99, 3, 10**12], rows))
    expected = np.stack(
        [flat[[by_key[int(k)] for k in row]].sum(axis=0) for row in keys]
    )
    out = model.predict(keys, verbose=0)  # compiled: the serving map
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(layer(keys)), expected, rtol=1e-5, atol=1e-6)
    path = str(tmp_path / "h.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    twin = loaded.get_layer("ids")
    for name, variable in layer.quantized_rows.items():
        np.testing.assert_array_equal(np.asarray(twin.quantized_rows[name]), variable)
    np.testing.assert_array_equal(loaded.predict(keys, verbose=0), out)
    with pytest.raises(ValueError, match="'ids'.*quantized.*inserting keys"):
        layer(np.array([[123456, 5]]), training=True)
    assert layer.stats()["size"] == 5


def test_quantize_refuses_unknown_modes_naming_the_layer():
    col = ks.EmbeddingCollection({"t": ks.TableConfig(10, 4)}, name="feats")
    col.build()
    with pytest.raises(NotImplementedError, match="'feats'.*'float8'"):
        col.quantize("float8")


def _dir_bytes(path):
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.skipif(
    BACKEND not in ("jax", "tensorflow"),
    reason="model.export(format='tf_saved_model') needs JAX or TensorFlow",
)
def test_int8_model_exports_smaller_and_serves_like_predict(tmp_path):
    from tests.test_export import _serve_fresh

    keys = keras.Input((2,), dtype="int64", name="keys")
    ids = keras.Input((2,), dtype="int32", name="ids")
    hashed = ks.DistributedHashEmbedding(
        64, capacity=1024, combiner="sum", optimizer="adagrad", name="hashed"
    )
    dense = ks.AllToAllDenseEmbedding(
        4000, 64, combiner="sum", optimizer="adagrad", name="dense"
    )
    col = ks.EmbeddingCollection(
        {"t": ks.TableConfig(2000, 64, combiner="sum")}, optimizer="sgd", name="col"
    )
    parts = [hashed(keys), dense(ids), col({"t": ids})["t"]]
    model = keras.Model([keys, ids], keras.layers.Concatenate()(parts))
    rng = np.random.default_rng(3)
    x = [rng.integers(0, 500, (16, 2)) * 7_919_993_123, rng.integers(0, 2000, (16, 2))]
    x[1] = x[1].astype("int32")
    hashed(x[0], training=True)
    model.export(tmp_path / "float", format="tf_saved_model", verbose=False)
    float_out = model.predict(x, verbose=0)
    model.quantize("int8")
    expected = model.predict(x, verbose=0)
    assert 0 < np.abs(expected - float_out).max() < 0.02
    model.export(tmp_path / "int8", format="tf_saved_model", verbose=False)
    ratio = _dir_bytes(tmp_path / "int8") / _dir_bytes(tmp_path / "float")
    assert ratio < 0.35, ratio
    if BACKEND == "jax":  # the converted artifact, in a TensorFlow-only process
        served = _serve_fresh(tmp_path, tmp_path / "int8", x)
    else:
        import tensorflow as tf

        artifact = tf.saved_model.load(str(tmp_path / "int8"))
        served = artifact.serve(x)
    np.testing.assert_allclose(served, expected, atol=1e-6, rtol=0)
