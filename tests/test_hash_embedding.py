"""DistributedHashEmbedding: hash-table keys -> rows with sparse training."""

import os

import keras
import numpy as np
import pytest
from keras import ops

from keras_sparse.layers.hash.embedding import DistributedHashEmbedding
from keras_sparse.table import TableFullError
from keras_sparse.table import hash_strings
from tests.conftest import backend

DIM = 4


def _jit_modes():
    if backend() == "torch":
        return [dict(jit_compile=False), dict(run_eagerly=True)]
    return [dict(jit_compile=True), dict(jit_compile=False)]


@keras.saving.register_keras_serializable(package="keras_sparse_tests")
class SumLast(keras.layers.Layer):
    def call(self, x):
        return ops.sum(x, axis=-1, keepdims=True)

    def compute_output_shape(self, shape):
        return tuple(shape[:-1]) + (1,)


def _model(layer, bag, dtype="int32"):
    ids = keras.Input((bag,), dtype=dtype)
    return keras.Model(ids, SumLast()(layer(ids)))


def _data(num_keys=24, batch=8, bag=3, steps=6, seed=0, wide=False):
    rng = np.random.default_rng(seed)
    vocab = rng.choice(2**31 - 1, size=num_keys, replace=False).astype("int64")
    if wide:
        # Keys that agree in their low 32 bits (JAX without x64 would merge
        # them), negative keys and the int64 extremes.
        vocab[: num_keys // 2] += np.int64(2**32) * rng.integers(
            -(2**30), 2**30, size=num_keys // 2
        )
        vocab[num_keys // 2 : num_keys // 2 + 4] = vocab[:4] + np.int64(2**40)
        vocab[-2:] = [np.iinfo(np.int64).min, np.iinfo(np.int64).max]
        assert len(set(vocab.tolist())) == num_keys
    idx = rng.integers(0, num_keys, size=(batch * steps, bag))
    y = rng.normal(size=(batch * steps, 1)).astype("float32")
    return vocab, vocab[idx].astype("int64" if wide else "int32"), y


def _first_seen(keys):
    order = {}
    for k in keys.reshape(-1):
        order.setdefault(int(k), len(order))
    return order


def _np(x):
    return ops.convert_to_numpy(x)


# --------------------------------------------------------------- correctness
@pytest.mark.parametrize("wide", [False, True], ids=["int32_keys", "int64_keys"])
@pytest.mark.parametrize("mode", _jit_modes(), ids=str)
def test_training_matches_dense_reference(mode, wide):
    # int64_keys: full 64-bit keys straight from NumPy into fit/evaluate/
    # predict (on JAX without x64 they reach the host mapping whole).
    vocab, x, y = _data(wide=wide)
    order = _first_seen(x)
    dense_x = np.vectorize(order.get)(x).astype("int32")
    init = keras.initializers.Constant(0.1)

    # Keras' own Adagrad on TensorFlow applies the IndexedSlices gradient of
    # duplicate ids one by one (not summed), so the TF reference uses SGD.
    def make_opt():
        if backend() == "tensorflow":
            return keras.optimizers.SGD(0.2)
        return keras.optimizers.Adagrad(0.2)

    hashed = DistributedHashEmbedding(
        DIM,
        capacity=64,
        combiner="sum",
        embeddings_initializer=init,
        optimizer=make_opt(),
    )
    model = _model(hashed, 3, "int64" if wide else "int32")
    model.compile(keras.optimizers.SGD(0.0), "mse", **mode)
    if backend() == "tensorflow":  # host callbacks: XLA is switched off
        assert hashed.supports_jit is False and model.jit_compile is False
    ref_layer = keras.layers.Embedding(len(order), DIM, embeddings_initializer=init)
    ids = keras.Input((3,), dtype="int32")
    ref_out = keras.layers.Lambda(
        lambda t: ops.sum(ops.sum(t, axis=1), axis=-1, keepdims=True)
    )(ref_layer(ids))
    ref = keras.Model(ids, ref_out)
    ref.compile(make_opt(), "mse", **mode)

    # Validation batches interleave with training batches between epochs.
    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    h = model.fit(x, y, validation_data=(x[:16], y[:16]), **fit)
    r = ref.fit(dense_x, y, validation_data=(dense_x[:16], y[:16]), **fit)
    np.testing.assert_allclose(h.history["loss"], r.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(h.history["val_loss"], r.history["val_loss"], rtol=1e-5)

    records = hashed.export()
    assert len(records["keys"]) == len(order)
    table = _np(ref_layer.embeddings)
    want = table[[order[int(k)] for k in records["keys"]]]
    np.testing.assert_allclose(records["values"], want, rtol=1e-5, atol=1e-6)

    np.testing.assert_allclose(
        model.evaluate(x, y, batch_size=8, verbose=0),
        ref.evaluate(dense_x, y, batch_size=8, verbose=0),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        model.predict(x, batch_size=8, verbose=0),
        ref.predict(dense_x, batch_size=8, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )


def test_eager_int64_and_string_keys_and_shapes():
    layer = DistributedHashEmbedding(
        DIM, capacity=64, optimizer="sgd", embeddings_initializer="ones"
    )
    big = np.array([[2**40 + 1, 2**40 + 2]], dtype="int64")  # beyond int32
    out = _np(layer(big, training=True))
    assert out.shape == (1, 2, DIM)
    assert layer.stats()["size"] == 2
    assert sorted(layer.export()["keys"].tolist()) == [2**40 + 1, 2**40 + 2]
    strings = np.array([["user_1", "user_2", "user_1"]])
    layer(strings, training=True)
    keys = set(layer.export()["keys"].tolist())
    assert set(hash_strings(["user_1", "user_2"]).tolist()) <= keys
    # int32 keys, rank 3, weights 0 = padding (never inserted)
    ids = np.array([[[5, 6], [7, 8]]], dtype="int32")
    w = np.array([[[1.0, 0.0], [2.0, 1.0]]], dtype="float32")
    out = _np(layer(ids, weights=w, training=True))
    assert out.shape == (1, 2, 2, DIM)
    np.testing.assert_allclose(out[0, 0, 1], 0.0)
    np.testing.assert_allclose(out[0, 1, 0], 2.0)
    assert 6 not in layer.export()["keys"].tolist()
    # Duplicates of one new key share one freshly drawn row.
    rand = DistributedHashEmbedding(DIM, capacity=64, optimizer="adagrad")
    out = _np(rand(np.array([[9, 9, 9]]), training=True))[0]
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(out[0], out[2])
    assert np.all(out[0] != 0)
    np.testing.assert_array_equal(rand.export()["values"][0], out[0])
    np.testing.assert_array_equal(_np(rand(np.array([[9]])))[0, 0], out[0])
    pooled = DistributedHashEmbedding(
        DIM, capacity=64, optimizer="sgd", combiner="mean"
    )
    assert tuple(pooled(np.array([1, 2, 3]), training=True).shape) == (3, DIM)
    assert tuple(pooled(np.array([[1, 2], [3, 4]])).shape) == (2, DIM)


@pytest.mark.skipif(backend() != "tensorflow", reason="TF ragged/string tensors")
def test_tf_ragged_and_string_graph():
    import tensorflow as tf

    layer = DistributedHashEmbedding(
        DIM,
        capacity=64,
        optimizer="sgd",
        combiner="sum",
        embeddings_initializer="ones",
    )
    ragged = tf.ragged.constant([[1, 2, 3], [4]], dtype=tf.int64)
    np.testing.assert_allclose(_np(layer(ragged, training=True))[:, 0], [3.0, 1.0])
    inputs = keras.Input((2,), dtype="string")
    model = keras.Model(inputs, layer(inputs))
    out = model.predict(tf.constant([["a", "b"], ["a", "zz"]]), verbose=0)
    np.testing.assert_allclose(out[:, 0], [0.0, 0.0])  # unknown, nothing inserted
    layer(np.array([["a"]]), training=True)
    out = model.predict(tf.constant([["a", "b"], ["a", "zz"]]), verbose=0)
    np.testing.assert_allclose(out[:, 0], [1.0, 1.0])


# ------------------------------------------------------------------ eviction
def test_eviction_keeps_hot_keys_and_resets_fresh_rows():
    opt = keras.optimizers.Adagrad(0.5, initial_accumulator_value=0.1)
    layer = DistributedHashEmbedding(
        DIM,
        capacity=64,
        combiner="sum",
        optimizer=opt,
        eviction="lru",
        embeddings_initializer=keras.initializers.Constant(0.25),
    )
    model = _model(layer, 8)
    model.compile(keras.optimizers.SGD(0.0), "mse")
    hot = np.arange(1, 5, dtype="int32")
    cold = np.arange(1000, 1000 + 400, dtype="int32").reshape(-1, 4, 4)
    y = np.full((4, 1), 5.0, "float32")
    for step in range(cold.shape[0]):
        x = np.concatenate([np.tile(hot, (4, 1)), cold[step]], axis=1)
        model.train_on_batch(x, y)
    stats = layer.stats()
    assert stats["evictions"] > 0
    assert stats["size"] <= layer.capacity
    records = layer.export()
    live = records["keys"].tolist()
    assert len(set(live)) == len(live)
    assert set(hot.tolist()) <= set(live)
    hot_values = records["values"][np.isin(records["keys"], hot)]
    assert np.all(np.abs(hot_values - 0.25) > 1e-3)  # trained, not reset
    evicted = [k for k in cold[:4].reshape(-1).tolist() if k not in live]
    assert evicted
    # An evicted key reads zeros in inference (never another key's vector)...
    np.testing.assert_allclose(_np(layer(np.array([evicted[:2]]))), 0.0)
    # ...and comes back with a fresh row and reset slots.
    out = _np(layer(np.array([[evicted[0]]]), training=True))
    np.testing.assert_allclose(out, 0.25)
    records = layer.export()
    i = records["keys"].tolist().index(evicted[0])
    np.testing.assert_allclose(records["values"][i], 0.25)
    np.testing.assert_allclose(records["accumulator"][i], 0.1)


def test_full_table_without_eviction_raises_before_changes():
    layer = DistributedHashEmbedding(DIM, capacity=64, optimizer="sgd", eviction=None)
    with pytest.raises(TableFullError, match=r"capacity=64, size=\d+"):
        for start in range(0, 10_000, 4):  # until both buckets of a key are full
            before = layer.export()
            iterations = int(_np(layer.sparse_iterations))
            layer(np.arange(start, start + 4)[None], training=True)
    after = layer.export()
    np.testing.assert_array_equal(before["keys"], after["keys"])
    np.testing.assert_array_equal(before["values"], after["values"])
    assert int(_np(layer.sparse_iterations)) == iterations


# ----------------------------------------------------------------- admission
def test_admission_after_n_sightings():
    layer = DistributedHashEmbedding(
        DIM,
        capacity=64,
        combiner="sum",
        optimizer=keras.optimizers.SGD(0.5),
        admit_after=3,
        embeddings_initializer="ones",
    )
    model = _model(layer, 2)
    model.compile(keras.optimizers.SGD(0.0), "mse")
    x = np.array([[7, 8]], "int32")
    y = np.array([[10.0]], "float32")
    for _ in range(2):
        model.train_on_batch(x, y)
        assert layer.stats()["size"] == 0
        np.testing.assert_allclose(_np(layer(x)), 0.0)
    np.testing.assert_allclose(_np(layer.embeddings), 1.0)  # nothing trained
    model.train_on_batch(x, y)
    assert sorted(layer.export()["keys"].tolist()) == [7, 8]
    assert np.all(np.abs(layer.export()["values"] - 1.0) > 1e-3)


def test_inference_inserts_nothing():
    layer = DistributedHashEmbedding(DIM, capacity=64, optimizer="adagrad")
    model = _model(layer, 3)
    model.compile("sgd", "mse")
    x = np.array([[1, 2, 3], [4, 5, 6]], "int32")
    np.testing.assert_allclose(model.predict(x, verbose=0), 0.0)
    model.evaluate(x, np.zeros((2, 1)), verbose=0)
    np.testing.assert_allclose(_np(layer(x, training=False)), 0.0)
    assert layer.stats()["size"] == 0
    layer(x[:1], training=True)
    out = _np(layer(x, training=False))
    assert np.all(out[0] != 0) and np.all(out[1] == 0)
    assert layer.stats()["size"] == 3


@pytest.mark.parametrize("capacity", [64, 4096], ids=["same", "larger"])
def test_admission_counts_survive_save_load(tmp_path, capacity):
    def make(cap):
        layer = DistributedHashEmbedding(
            DIM, capacity=cap, combiner="sum", optimizer="sgd", admit_after=3
        )
        layer(np.array([[1, 2]]), training=False)  # build, inserts nothing
        return layer

    layer = make(64)
    for _ in range(2):
        layer(np.array([[7, 8]]), training=True)
    layer(np.array([[9, 9]]), training=True)  # 9 seen twice too (one batch)
    assert layer.stats()["size"] == 0
    path = os.path.join(tmp_path, "w.weights.h5")
    keras.Sequential([keras.Input((2,), dtype="int32"), layer]).save_weights(path)
    loaded = make(capacity)
    keras.Sequential([keras.Input((2,), dtype="int32"), loaded]).load_weights(path)
    # The third sighting admits 7, 8 and 9 in the loaded layer; 5 is new.
    loaded(np.array([[7, 8], [9, 5]]), training=True)
    assert sorted(loaded.export()["keys"].tolist()) == [7, 8, 9]


# -------------------------------------------------------------- save / load
def _save_model(capacity):
    layer = DistributedHashEmbedding(
        DIM,
        capacity=capacity,
        combiner="mean",
        optimizer="adagrad",
        embeddings_initializer="uniform",
        name="hashed",
    )
    model = _model(layer, 3)
    model.compile(keras.optimizers.SGD(0.0), "mse")
    return model, layer


def test_save_load_roundtrip_and_continue(tmp_path):
    vocab, x, y = _data(steps=4)
    model, layer = _save_model(64)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    new_layer = loaded.get_layer("hashed")
    assert isinstance(new_layer, DistributedHashEmbedding)
    assert new_layer.get_config() == layer.get_config()
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6
    )
    # Training continues identically (same records, slots, step, seed).
    x2 = np.concatenate([x[:8, :2], np.full((8, 1), 77, "int32")], axis=1)
    for _ in range(2):
        a = model.train_on_batch(x2, y[:8])
        b = loaded.train_on_batch(x2, y[:8])
        np.testing.assert_allclose(a, b, rtol=1e-6)
    ra, rb = layer.export(), new_layer.export()
    oa, ob = np.argsort(ra["keys"]), np.argsort(rb["keys"])
    for name in ("keys", "values", "accumulator"):
        np.testing.assert_allclose(ra[name][oa], rb[name][ob], rtol=1e-6)

    # Into a layer with another capacity (different rows, same outputs).
    weights_path = os.path.join(tmp_path, "m.weights.h5")
    model.save_weights(weights_path)
    other, other_layer = _save_model(256)
    other.load_weights(weights_path)
    assert other_layer.capacity == 256
    np.testing.assert_allclose(
        other.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6
    )
    a = model.train_on_batch(x2, y[:8])
    b = other.train_on_batch(x2, y[:8])
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_export_import_warm_start():
    vocab, x, y = _data(steps=2)
    model, layer = _save_model(64)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    records = layer.export()
    assert set(records) == {"keys", "values", "accumulator", "scores"}
    other, other_layer = _save_model(128)
    other.build((None, 3))
    count = other_layer.import_(records["keys"], records["values"])
    assert count == len(records["keys"]) > 0
    np.testing.assert_allclose(
        other.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6
    )
    got = other_layer.export()
    np.testing.assert_allclose(got["accumulator"], 0.1)  # slots start fresh


def test_config_roundtrip():
    layer = DistributedHashEmbedding(
        3,
        capacity=100,
        combiner="sum",
        optimizer="sgd",
        eviction="lfu",
        admit_after=2,
        key_dtype="int32",
    )
    config = layer.get_config()
    clone = DistributedHashEmbedding.from_config(config)
    assert clone.get_config() == config
    assert clone.capacity == layer.capacity >= 100
    assert clone.table.eviction == "lfu" and clone.table.admit_after == 2


# ----------------------------------------------------------------- bad input
def test_bad_inputs():
    layer = DistributedHashEmbedding(DIM, capacity=64, optimizer="sgd")
    with pytest.raises(TypeError, match="integer"):
        layer(np.array([[1.5, 2.0]]))
    for capacity in (0, -3, 2.5, "10", True):
        with pytest.raises(ValueError, match="capacity"):
            DistributedHashEmbedding(DIM, capacity=capacity, optimizer="sgd")
    with pytest.raises(ValueError, match="admit_after"):
        DistributedHashEmbedding(DIM, capacity=64, optimizer="sgd", admit_after=0)
    with pytest.raises(ValueError, match="sparse `optimizer`"):
        DistributedHashEmbedding(DIM, capacity=64, optimizer=None)
