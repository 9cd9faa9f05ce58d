"""The serving map: compiled inference without host callbacks.

References: the hash table's own ``lookup`` (an independent implementation:
bucketed cuckoo probing, not a sorted search) and the layer's eager
inference, which maps keys on the host.
"""

import contextlib
import re

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import keras_sparse as ks
from keras_sparse.layers.hash import serving_map

BACKEND = keras.backend.backend()
_INT64 = st.integers(-(2**63), 2**63 - 1)
# Where the two 32-bit words change sign or carry.
_EDGES = [0, -1, 1, 2**31 - 1, -(2**31), 2**31, 2**32 - 1, 2**32, -(2**32), 2**63 - 1]
_EDGES += [-(2**63)]


@contextlib.contextmanager
def _x64():
    """64-bit integers on JAX (the serving map's int64 route)."""
    if BACKEND != "jax":
        yield
        return
    import jax

    with jax.enable_x64(True):
        yield


def _filled(keys, capacity=256):
    layer = ks.DistributedHashEmbedding(
        4, capacity=capacity, optimizer="sgd", eviction=None, name="h"
    )
    layer.build()
    layer.table.import_(np.asarray(keys, np.int64))
    assert serving_map.refresh(layer)
    return layer


def _padded(queries, dtype):
    """``queries`` padded to one length with the edge keys: every example
    of a property test then reuses the compiled ops of one shape."""
    pad = np.resize(np.array(_EDGES, np.int64).astype(dtype), 96 - len(queries))
    return np.concatenate([np.asarray(queries, dtype), pad])


def _searched(layer, queries, dtype):
    with _x64():
        keys = keras.ops.convert_to_tensor(np.asarray(queries, dtype))
        return keras.ops.convert_to_numpy(serving_map.lookup(layer, keys))


@settings(max_examples=25, deadline=None)
@given(
    stored=st.lists(
        st.one_of(_INT64, st.sampled_from(_EDGES)), max_size=60, unique=True
    ),
    unknown=st.lists(st.one_of(_INT64, st.sampled_from(_EDGES)), max_size=30),
)
def test_int64_search_matches_table_lookup(stored, unknown):
    layer = _filled(stored)
    queries = _padded(stored + unknown, np.int64)
    expected = layer.table.lookup(queries)
    np.testing.assert_array_equal(_searched(layer, queries, np.int64), expected)


@settings(max_examples=25, deadline=None)
@given(
    stored=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=60, unique=True),
    unknown=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=30),
)
def test_int32_search_matches_table_lookup(stored, unknown):
    layer = _filled(stored)
    queries = _padded(stored + unknown, np.int32)
    expected = layer.table.lookup(queries.astype(np.int64))
    found = keras.ops.convert_to_numpy(
        serving_map.lookup(layer, keras.ops.convert_to_tensor(queries))
    )
    np.testing.assert_array_equal(found, expected)


@settings(max_examples=30, deadline=None)
@given(
    words=st.lists(
        st.tuples(st.integers(-(2**31), 2**31 - 1), st.integers(-(2**31), 2**31 - 1)),
        min_size=1,
        max_size=40,
    ),
    bits=st.integers(1, 31),
)
def test_in_graph_buckets_equal_the_host_buckets(words, bits):
    high, low = (np.array(w, np.int32) for w in zip(*words))
    found = serving_map.bucket_of(
        keras.ops.convert_to_tensor(high), keras.ops.convert_to_tensor(low), bits
    )
    expected = serving_map.buckets(high, low, bits)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(found), expected)


def test_crowded_buckets_are_searched_whole():
    """Thousands of keys: buckets hold several keys and need several rounds."""
    rng = np.random.default_rng(3)
    stored = np.unique(rng.integers(-(2**62), 2**62, size=2000))
    layer = _filled(stored, capacity=4096)
    assert int(keras.ops.convert_to_numpy(layer.serving_meta)[2]) >= 2
    queries = np.concatenate([stored, rng.integers(-(2**62), 2**62, size=1000)])
    np.testing.assert_array_equal(
        _searched(layer, queries, np.int64), layer.table.lookup(queries)
    )


def test_full_and_empty_maps():
    layer = _filled([])
    np.testing.assert_array_equal(_searched(layer, [0, 5, -1], np.int64), [-1] * 3)
    # Every row taken: no padding words after the last key.
    layer = ks.DistributedHashEmbedding(4, capacity=64, optimizer="sgd", name="h")
    layer.build()
    for start in range(0, 640, 32):
        layer.table.lookup_or_insert(np.arange(start, start + 32) * 2**33 - 5)
    assert layer.table.size == 64
    assert serving_map.refresh(layer)
    keys = layer.table.export()[0]
    queries = np.concatenate([keys, keys + 1])
    np.testing.assert_array_equal(
        _searched(layer, queries, np.int64), layer.table.lookup(queries)
    )


def test_refresh_follows_the_table_version():
    layer = ks.DistributedHashEmbedding(
        4, capacity=128, optimizer="adagrad", name="h", admit_after=2
    )
    layer.build()
    assert serving_map.refresh(layer)  # first write: stamps the empty map
    layer(np.array([1, 2]), training=True)  # sketch only: not admitted yet
    assert not serving_map.refresh(layer)  # the map did not change
    layer(np.array([1, 2]), training=True)  # admitted now
    assert serving_map.refresh(layer)
    assert not serving_map.refresh(layer)
    layer(np.array([1, 2]), training=False)  # lookups change nothing
    layer(np.array([1, 2]), training=True)  # neither do hits
    assert not serving_map.refresh(layer)
    np.testing.assert_array_equal(
        _searched(layer, [1, 2, 3], np.int64), layer.table.lookup(np.array([1, 2, 3]))
    )
    layer.table.erase(np.array([1]))
    assert serving_map.refresh(layer)
    assert _searched(layer, [1], np.int64)[0] == -1
    # Stale variables (e.g. written back by a training loop that held an
    # older copy) are noticed by their recorded version.
    old = keras.ops.convert_to_numpy(layer.serving_meta)
    layer.import_(np.array([7]), np.ones((1, 4), "float32"))
    assert serving_map.refresh(layer)
    layer.serving_meta.assign(old)
    assert serving_map.refresh(layer)
    layer.table.clear()
    assert serving_map.refresh(layer)
    assert int(keras.ops.convert_to_numpy(layer.serving_meta)[0]) == 0
    # Another layer's map (same version count) is not taken for this one's.
    other = ks.DistributedHashEmbedding(4, capacity=128, optimizer="sgd")
    other.build()
    other.serving_meta.assign(keras.ops.convert_to_numpy(layer.serving_meta))
    other.table._version = layer.table.version
    assert serving_map.refresh(other)


def _model(key_dtype="int64", weights=False):
    keys = keras.Input((3,), dtype="int64", name="keys")
    inputs = [keys]
    layer = ks.DistributedHashEmbedding(
        4,
        capacity=512,
        combiner="mean",
        optimizer="adagrad",
        key_dtype=key_dtype,
        name="hashed",
    )
    if weights:
        inputs.append(keras.Input((3,), dtype="float32", name="w"))
        pooled = layer(keys, weights=inputs[1])
    else:
        pooled = layer(keys)
    model = keras.Model(inputs, keras.layers.Dense(1)(pooled))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model, layer


def _data(n=256, seed=0, wide=True):
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 150, size=(n, 3)).astype(np.int64)
    if wide:
        keys = keys * 7_919_993_123 - (3 << 40)
    w = rng.uniform(0.5, 2.0, size=(n, 3)).astype("float32")
    w[::5, 2] = 0.0
    return keys, w, rng.normal(size=(n, 1)).astype("float32")


def _eager(model, layer, keys, w=None):
    """The model's inference with the layer called eagerly on NumPy keys
    (a functional model's own call would convert them to JAX's int32)."""
    pooled = layer(keys, weights=w, training=False)
    return keras.ops.convert_to_numpy(model.layers[-1](pooled))


def _refuse_host_mapping(layer, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("compiled inference reached the host table")

    monkeypatch.setattr(layer, "_map_step_keys", refuse)


@pytest.mark.skipif(BACKEND == "torch", reason="torch runs inference eagerly")
def test_predict_and_evaluate_run_without_the_host_table(monkeypatch):
    """Compiled inference reads the serving map, refreshed as training
    changes the table, and agrees with the eager (host) lookup."""
    # On JAX without x64 only key_dtype="int32" keys reach the step whole.
    wide = BACKEND != "jax"
    model, layer = _model("int64" if wide else "int32", weights=True)
    keys, w, y = _data(wide=wide)
    val = _data(64, seed=1, wide=wide)
    for epoch in range(2):  # new keys arrive between the predicts
        part = slice(epoch * 128, (epoch + 1) * 128)
        history = model.fit(
            [keys[part], w[part]],
            y[part],
            batch_size=32,
            validation_data=([val[0], val[1]], val[2]),
            verbose=0,
        )
        with monkeypatch.context() as patch:
            _refuse_host_mapping(layer, patch)
            predicted = model.predict([keys, w], batch_size=64, verbose=0)
            evaluated = model.evaluate([val[0], val[1]], val[2], verbose=0)
        eager = _eager(model, layer, keys, w)
        np.testing.assert_allclose(predicted, eager, atol=1e-6)
        # fit's validation saw the map of the finished epoch, as evaluate does.
        np.testing.assert_allclose(history.history["val_loss"][-1], evaluated, 1e-5)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX without x64 truncates int64")
def test_default_int64_keys_keep_the_host_mapping_without_x64():
    model, layer = _model("int64")
    keys, _, y = _data()
    model.fit(keys, y, batch_size=64, verbose=0)
    predicted = model.predict(keys, batch_size=64, verbose=0)
    eager = _eager(model, layer, keys)
    np.testing.assert_allclose(predicted, eager, atol=1e-6)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX without x64 truncates int64")
def test_declared_int32_keys_beyond_int32_are_refused():
    model, layer = _model("int32")
    keys, _, y = _data(wide=False)
    model.fit(keys, y, batch_size=64, verbose=0)
    keys[7, 1] = 2**40
    with pytest.raises(ValueError, match="'hashed'.*key_dtype='int32'"):
        model.predict(keys, batch_size=64, verbose=0)
    with pytest.raises(ValueError, match="'hashed'.*key_dtype='int32'"):
        model.fit(keys, y, batch_size=64, verbose=0)


@pytest.mark.skipif(BACKEND != "jax", reason="jax.export")
def test_jax_exported_inference_has_no_callback():
    """A `jax.export` of the model's stateless inference: no host callback
    in the serialized program, and the same outputs as `predict`."""
    import jax
    from jax import export as jax_export

    model, layer = _model("int32")
    keys, _, y = _data(wide=False)
    model.fit(keys, y, batch_size=64, verbose=0)
    assert ks.refresh_serving_maps(model) == ["hashed"]
    trainable = [v.value for v in model.trainable_variables]
    frozen = [v.value for v in model.non_trainable_variables]

    def infer(trainable, frozen, x):
        return model.stateless_call(trainable, frozen, x, training=False)[0]

    spec = jax.ShapeDtypeStruct(keys.shape, "int32")
    exported = jax_export.export(jax.jit(infer))(trainable, frozen, spec)
    custom_calls = re.findall(r"custom_call @(\w+)", exported.mlir_module())
    assert not [c for c in custom_calls if "callback" in c], custom_calls
    restored = jax_export.deserialize(exported.serialize())
    served = restored.call(trainable, frozen, keys.astype("int32"))
    expected = model.predict(keys, batch_size=256, verbose=0)
    np.testing.assert_allclose(np.asarray(served), expected, atol=1e-6)


@pytest.mark.skipif(BACKEND == "torch", reason="torch has few uint32 ops")
def test_unsigned_32_bit_keys_above_int32_max():
    stored = [3_000_000_000, 2**31, 5]
    layer = _filled(stored)
    queries = np.array(stored + [2**32 - 1], np.uint32)
    expected = layer.table.lookup(queries.astype(np.int64))
    np.testing.assert_array_equal(_searched(layer, queries, np.uint32), expected)
    assert expected[0] >= 0 and expected[-1] == -1


@pytest.mark.skipif(BACKEND == "torch", reason="torch runs inference eagerly")
def test_a_frozen_layer_in_a_training_step_reads_the_table(monkeypatch):
    """``trainable=False`` under ``fit``: no inserts, and no serving map
    either (predict was never run, so the map is still empty)."""
    model, layer = _model("int32")
    keys, _, y = _data(wide=False)
    layer.import_(np.unique(keys), np.ones((np.unique(keys).size, 4), "float32"))
    layer.trainable = False
    model.compile(keras.optimizers.SGD(0.0), "mse")
    history = model.fit(keys, y, batch_size=256, verbose=0)
    assert not serving_map.is_current(layer)  # fit never refreshed it
    expected = model.evaluate(keys, y, batch_size=256, verbose=0)  # refreshes
    np.testing.assert_allclose(history.history["loss"][0], expected, rtol=1e-5)
