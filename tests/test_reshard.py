"""Checkpoints saved under one mesh load under another (JAX)."""

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse import sharding

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="sharding is implemented for JAX"
)

ROWS, DIM, BAG, BATCH, STEPS = 64, 8, 3, 32, 4


def _layers():
    return [
        ks.AllToAllDenseEmbedding(
            ROWS, DIM, combiner="sum", optimizer="adagrad", sharding="row", name="big"
        ),
        ks.AllToAllDenseEmbedding(
            16, DIM, combiner="sum", optimizer="adam", sharding="data", name="small"
        ),
    ]


def _model(layers):
    big, small = layers
    a = keras.Input((BAG,), dtype="int32", name="a")
    b = keras.Input((BAG,), dtype="int32", name="b")
    h = keras.layers.Concatenate()([big(a), small(b)])
    model = keras.Model([a, b], keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def _data(seed=0):
    rng = np.random.default_rng(seed)
    n = BATCH * STEPS
    x = [
        rng.integers(0, ROWS, size=(n, BAG)).astype("int32"),
        rng.integers(0, 16, size=(n, BAG)).astype("int32"),
    ]
    return x, rng.normal(size=(n, 1)).astype("float32")


def _state(model):
    """Every model weight and optimizer variable by path, as numpy.

    Weights, not ``model.variables``: a single-device table also carries a
    dedup scratch (`keras_sparse.layers.dedup_scratch`), step state that is
    never saved and that sharded tables do without.
    """
    out = {v.path: np.array(v.value) for v in model.weights}
    out.update({v.path: np.array(v.value) for v in model.optimizer.variables})
    return out


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _shards(model, name="big"):
    var = model.get_layer(name).embeddings.value
    return len(var.sharding.device_set), {
        tuple(s.data.shape) for s in var.addressable_shards
    }


def _fit(model, x, y):
    hist = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return hist.history["loss"]


def test_reshard_round_trip(tmp_path):
    x, y = _data()
    layers = _layers()
    keras.distribution.set_distribution(sharding.distribution(layers, devices=8))
    try:
        model = _model(layers)
        _fit(model, x, y)
        assert _shards(model) == (8, {(ROWS // 8, DIM)})
        want = _state(model)
        assert int(want["big/sparse_iterations"]) == STEPS
        assert int(want["small/sparse_iterations"]) == STEPS
        path8 = str(tmp_path / "m8.keras")
        model.save(path8)
        # The original keeps training for the continuation check below.
        x2, y2 = _data(1)
        cont8 = _fit(model, x2, y2)
    finally:
        keras.distribution.set_distribution(None)

    # 8 (row) -> 4 (row): a DeviceMesh over the first 4 devices.
    import jax

    try:
        m4, dist4 = sharding.load_model(path8, devices=jax.devices()[:4])
        assert dist4.keras_sparse_plan.strategy("big") == "row"
        assert _shards(m4) == (4, {(ROWS // 4, DIM)})
        assert _shards(m4, "small") == (4, {(16, DIM)})
        _assert_same(_state(m4), want)
        path4 = str(tmp_path / "m4.keras")
        m4.save(path4)
    finally:
        keras.distribution.set_distribution(None)

    # 4 -> 1 device (no distribution).
    m1, dist1 = sharding.load_model(path4, devices=1)
    assert dist1 is None and _shards(m1) == (1, {(ROWS, DIM)})
    _assert_same(_state(m1), want)
    path1 = str(tmp_path / "m1.keras")
    m1.save(path1)

    # 1 -> 8 devices, column-wise this time; then it trains like the original.
    try:
        m8c, dist8c = sharding.load_model(path1, devices=8, plan={"big": "column"})
        assert dist8c.keras_sparse_plan.strategy("big") == "column"
        assert (
            sharding.keras_integration.route(m8c.get_layer("big")).strategy == "column"
        )
        assert _shards(m8c) == (8, {(ROWS, DIM // 8)})
        acc = m8c.get_layer("big").slots["accumulator"].value
        assert {tuple(s.data.shape) for s in acc.addressable_shards} == {
            (ROWS, DIM // 8)
        }
        _assert_same(_state(m8c), want)
        np.testing.assert_allclose(_fit(m8c, x2, y2), cont8, atol=1e-5, rtol=1e-5)
    finally:
        keras.distribution.set_distribution(None)
