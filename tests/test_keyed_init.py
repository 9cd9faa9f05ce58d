"""A hash layer's fresh rows start from a function of (layer seed, key).

The reference is a NumPy implementation of the same counter-based hash in
uint32 arithmetic (MurmurHash3's fmix32) and SciPy's float64 ``erfinv``:
each key's first vector must equal it, whatever step, batch position, route
(eager, compiled step, TensorFlow graph, HashEmbeddingCollection, key
sharding over 8 devices) or backend admits the key.
"""

import keras
import numpy as np
import pytest
from scipy.special import erfinv

import keras_sparse as ks
from keras_sparse.layers.hash import jax_step_mapping
from keras_sparse.ops import key_hash
from keras_sparse.table.sharded_table import key_words

DIM = 4
SEED = 3  # table_seed
BIG = (1 << 40) + 17  # a key beyond 32 bits
KEYS = np.array([-5, 12345, BIG, -(1 << 50) - 3, 0, 7], np.int64)


def _mix(x):
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x85EBCA6B)
    x ^= x >> np.uint32(13)
    x *= np.uint32(0xC2B2AE35)
    x ^= x >> np.uint32(16)
    return x


def _uniforms(keys, seed, dim):
    """float64 ``[len(keys), dim]``: the reference hash's uniforms."""
    u = np.asarray(keys, np.int64).view(np.uint64)
    hi = (u >> np.uint64(32)).astype(np.uint32)
    lo = (u & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    s = _mix(np.array([(seed + 0x9E3779B9) % (1 << 32)], np.uint64))
    with np.errstate(over="ignore"):
        a = _mix(hi ^ s)
        b = _mix(lo ^ a)
        cols = (np.arange(dim, dtype=np.uint64) * np.uint64(0x9E3779B9)).astype(
            np.uint32
        )
        h = _mix(_mix(b[:, None] ^ cols[None, :]) ^ a[:, None])
    return ((h >> np.uint32(9)).astype(np.float64) + 0.5) / 2.0**23


def _reference(init, keys, capacity):
    """First vectors of ``keys`` for the initializer name ``init`` of a layer
    with ``table_seed=SEED`` and ``capacity`` rows."""
    u = _uniforms(keys, SEED + 1, DIM)
    if init == "uniform":  # Keras' RandomUniform(-0.05, 0.05)
        return -0.05 + 0.1 * u
    if init == "random_normal":  # RandomNormal(0, 0.05)
        return 0.05 * np.sqrt(2) * erfinv(2 * u - 1)
    if init == "truncated_normal":  # TruncatedNormal(0, 0.05): within 2 sd
        return 0.05 * np.sqrt(2) * erfinv((2 * u - 1) * 0.9544997361036416)
    assert init == "glorot_uniform"  # fans: the whole table
    limit = np.sqrt(6.0 / (capacity + DIM))
    return -limit + 2 * limit * u


def _layer(init="uniform", **kwargs):
    args = dict(
        capacity=64,
        optimizer=keras.optimizers.SGD(1e-30),  # values stay the first ones
        embeddings_initializer=init,
        table_seed=SEED,
    )
    args.update(kwargs)
    return ks.DistributedHashEmbedding(DIM, **args)


def _vectors(layer, keys):
    """The layer's current vectors of ``keys`` (all must have rows)."""
    got_keys, rows, _ = layer.table.export()
    where = {int(k): int(r) for k, r in zip(got_keys, rows)}
    table = np.asarray(keras.ops.convert_to_numpy(layer.embeddings))
    return table[[where[int(k)] for k in keys]]


def test_reference_hash_matches_the_ops():
    words = key_words(KEYS)
    got = keras.ops.convert_to_numpy(key_hash.key_uniforms(words, 11, 5))
    np.testing.assert_array_equal(got, _uniforms(KEYS, 11, 5).astype(np.float32))
    assert 0 < got.min() and got.max() < 1


@pytest.mark.parametrize(
    "init", ["uniform", "random_normal", "truncated_normal", "glorot_uniform"]
)
def test_a_key_starts_from_its_reference_vector_in_any_order(init):
    first, later = _layer(init), _layer(init)
    first(np.array([-5, 12345]), training=True)
    # The other layer: another step, batch and position for each key.
    later(np.array([BIG, 12345, 3]), training=True)
    later(np.array([[9, 12345], [-5, BIG]]), training=True)
    np.testing.assert_array_equal(
        _vectors(first, [-5, 12345]), _vectors(later, [-5, 12345])
    )
    ref = _reference(init, [-5, 12345, BIG], later.capacity)
    np.testing.assert_allclose(
        _vectors(later, [-5, 12345, BIG]), ref, rtol=1e-5, atol=1e-7
    )


def test_layer_seed_changes_the_vectors_and_constants_stay_exact():
    a, b = _layer(), _layer(table_seed=SEED + 1)
    for layer in (a, b):
        layer(np.array([-5]), training=True)
    assert not np.allclose(_vectors(a, [-5]), _vectors(b, [-5]))
    ones = _layer("ones")
    ones(np.array([-5, 8]), training=True)
    np.testing.assert_array_equal(_vectors(ones, [-5, 8]), np.ones((2, DIM)))


def _fit_model(layer, keys, steps=2):
    """One input of int64 bags through ``layer`` (sum) into a Dense."""
    x_in = keras.Input((2,), dtype="int64")
    out = keras.layers.Dense(1)(layer(x_in))
    model = keras.Model(x_in, out)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    y = np.zeros((len(keys), 1), np.float32)
    model.fit(keys, y, batch_size=len(keys) // steps, verbose=0, shuffle=False)
    return model


@pytest.mark.parametrize("in_place", [True, False])
def test_fit_starts_keys_as_eager_calls_do(in_place, monkeypatch):
    # Compiled steps (JAX: in-place or io_callback, which return the high
    # words of the full 64-bit keys; TF: the graph's own int64 keys; torch:
    # eager) against the reference.
    if not in_place and keras.backend.backend() != "jax":
        pytest.skip("JAX callback routes")
    monkeypatch.setattr(jax_step_mapping, "IN_PLACE_CALLBACKS", in_place)
    keys = np.stack([KEYS, KEYS[::-1] + 1], axis=1)
    layer = _layer(combiner="sum")
    _fit_model(layer, keys)
    flat = np.unique(keys)
    ref = _reference("uniform", flat, layer.capacity)
    np.testing.assert_allclose(_vectors(layer, flat), ref, rtol=1e-5, atol=1e-7)


def test_collection_fields_start_keys_by_key():
    fields = {
        name: _layer(combiner="sum", name=name, table_seed=SEED)
        for name in ("user", "item")
    }
    collection = ks.HashEmbeddingCollection(fields)
    inputs = {n: keras.Input((2,), dtype="int64", name=n) for n in fields}
    out = collection(inputs)
    model = keras.Model(inputs, keras.layers.Add()([out["user"], out["item"]]))
    model.compile(keras.optimizers.SGD(0.01), "mse")
    keys = np.stack([KEYS, KEYS[::-1] + 1], axis=1)
    x = {"user": keys, "item": keys[::-1] * 3}
    model.fit(x, np.zeros((6, DIM), np.float32), batch_size=3, verbose=0)
    for name in fields:
        flat = np.unique(x[name])
        ref = _reference("uniform", flat, fields[name].capacity)
        got = _vectors(fields[name], flat)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
