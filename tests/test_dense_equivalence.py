"""optimizer=None: outputs and gradients equal keras.layers.Embedding."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_sparse as ks
from tests.helpers import random_batches


def _reference(combiner, table, ids, weights=None):
    emb = keras.layers.Embedding(table.shape[0], table.shape[1], weights=[table])
    vectors = emb(ids)
    if weights is not None:
        vectors = vectors * ops.expand_dims(ops.convert_to_tensor(weights), -1)
    if combiner is None:
        return vectors
    total = ops.sum(vectors, axis=-2)
    if combiner == "sum":
        return total
    w = np.ones(ids.shape, "float32") if weights is None else weights
    if combiner == "mean":
        return total / ops.sum(w, axis=-1, keepdims=True)
    return total / ops.sqrt(ops.sum(np.square(w), axis=-1, keepdims=True))


@pytest.mark.parametrize("combiner", [None, "sum", "mean", "sqrtn"])
def test_outputs_match_keras_embedding(combiner):
    rng = np.random.default_rng(0)
    table = rng.normal(size=(30, 5)).astype("float32")
    ids = rng.integers(0, 30, size=(4, 6)).astype("int32")
    weights = rng.uniform(0.5, 2.0, size=ids.shape).astype("float32")
    layer = ks.AllToAllDenseEmbedding(30, 5, weights=table, combiner=combiner)
    np.testing.assert_allclose(
        ops.convert_to_numpy(layer(ids)),
        ops.convert_to_numpy(_reference(combiner, table, ids)),
        rtol=1e-6,
        atol=1e-6,
    )
    if combiner is not None:
        np.testing.assert_allclose(
            ops.convert_to_numpy(layer(ids, weights=weights)),
            ops.convert_to_numpy(_reference(combiner, table, ids, weights)),
            rtol=1e-5,
            atol=1e-6,
        )


def test_rank3_ids_like_keras():
    table = np.arange(40, dtype="float32").reshape(10, 4)
    ids = np.random.default_rng(1).integers(0, 10, size=(2, 3, 4))
    layer = ks.AllToAllDenseEmbedding(10, 4, weights=[table])
    out = ops.convert_to_numpy(layer(ids))
    assert out.shape == (2, 3, 4, 4)
    np.testing.assert_array_equal(out, table[ids])


@pytest.mark.parametrize("combiner", [None, "mean"])
def test_training_matches_keras_embedding(combiner):
    """Same data, same init, same optimizer: identical losses and tables."""
    num_rows, dim, bag = 40, 6, 3
    x, y = random_batches(num_rows, batch=16, bag=bag, steps=6, seed=3)
    init = np.random.default_rng(4).normal(size=(num_rows, dim)).astype("float32")

    def build(embedding):
        ids = keras.Input((bag,), dtype="int32")
        h = embedding(ids)
        if combiner is None:
            h = keras.layers.Flatten()(h)
        elif type(embedding) is keras.layers.Embedding:
            h = keras.layers.Lambda(lambda t: ops.mean(t, axis=1))(h)
        out = keras.layers.Dense(1, kernel_initializer="ones")(h)
        model = keras.Model(ids, out)
        model.compile(keras.optimizers.Adam(0.01), "mse")
        return model

    ours = ks.AllToAllDenseEmbedding(num_rows, dim, weights=init, combiner=combiner)
    ref = keras.layers.Embedding(num_rows, dim, weights=[init])
    m_ours, m_ref = build(ours), build(ref)
    h_ours = m_ours.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    h_ref = m_ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(h_ours.history["loss"], h_ref.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(
        ours.embeddings.numpy(), ref.embeddings.numpy(), rtol=1e-5, atol=1e-6
    )


def test_mask_zero_matches_keras():
    layer = ks.AllToAllDenseEmbedding(10, 3, mask_zero=True)
    ref = keras.layers.Embedding(10, 3, mask_zero=True)
    ids = np.array([[1, 0, 3], [0, 0, 2]])
    np.testing.assert_array_equal(
        ops.convert_to_numpy(layer.compute_mask(ids)),
        ops.convert_to_numpy(ref.compute_mask(ids)),
    )


def test_constructor_mirrors_keras_defaults():
    import inspect

    ours = inspect.signature(ks.AllToAllDenseEmbedding.__init__).parameters
    theirs = inspect.signature(keras.layers.Embedding.__init__).parameters
    for name, param in theirs.items():
        if name in ("self", "kwargs"):
            continue
        assert name in ours, name
        assert ours[name].default == param.default, name
