"""A plan mixing row, column and data tables trains like one device (JAX)."""

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse import sharding
from tests.helpers import fit_losses

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="sharding is implemented for JAX"
)

DIM, BAG, BATCH, STEPS = 8, 3, 32, 20
# name: (rows, strategy, sparse optimizer)
TABLES = {
    "row_a": (64, "row", "adagrad"),
    "row_b": (40, "row", "rowwise_adagrad"),
    "col": (48, "column", "adam"),
    "dat": (12, "data", "adagrad"),
    "nosparse": (24, "column", None),  # no sparse optimizer: dense gradient
}


def _layers():
    return [
        ks.AllToAllDenseEmbedding(
            rows, DIM, combiner="sum", optimizer=opt, sharding=strategy, name=name
        )
        for name, (rows, strategy, opt) in TABLES.items()
    ]


def _model(layers):
    inputs = [keras.Input((BAG,), dtype="int32", name=f"{n}_ids") for n in TABLES]
    pooled = [layer(x) for layer, x in zip(layers, inputs)]
    h = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()(pooled))
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def _data():
    rng = np.random.default_rng(7)
    n = BATCH * STEPS
    x = []
    for rows, _, _ in TABLES.values():
        ids = rng.integers(0, rows, size=(n, BAG)).astype("int32")
        ids[:, 0] = 1  # a hot row, duplicated across devices every step
        x.append(ids)
    return x, rng.normal(size=(n, 1)).astype("float32")


def _fit(model, x, y):
    return fit_losses(model, x, y, BATCH)


def _state(model):
    out = {}
    for name in TABLES:
        layer = model.get_layer(name)
        out[name] = np.array(layer.embeddings.value)
        for slot, var in getattr(layer, "slots", {}).items():
            out[f"{name}/{slot}"] = np.array(var.value)
    return out


def test_mixed_plan_matches_single_device():
    x, y = _data()
    ref = _model(_layers())
    init = [np.array(w) for w in ref.get_weights()]
    ref_losses = _fit(ref, x, y)
    ref_state = _state(ref)

    layers = _layers()
    dist = sharding.distribution(layers, devices=8)
    plan = dist.keras_sparse_plan
    assert {t.name: t.strategy for t in plan} == {
        n: s for n, (_, s, _) in TABLES.items()
    }
    keras.distribution.set_distribution(dist)
    try:
        model = _model(layers)
        model.set_weights(init)
        for name, (_, strategy, _) in TABLES.items():
            routing = sharding.keras_integration.route(model.get_layer(name))
            assert (routing and routing.strategy) == (
                strategy if strategy != "data" else None
            )
        losses = _fit(model, x, y)
        assert len(losses) == STEPS
        # Step by step, not only the end point.
        np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=1e-5)
        state = _state(model)
        assert state.keys() == ref_state.keys()
        for key, value in state.items():
            np.testing.assert_allclose(
                value, ref_state[key], atol=1e-5, rtol=1e-5, err_msg=key
            )
        shards = {
            n: {
                tuple(s.data.shape)
                for s in model.get_layer(n).embeddings.value.addressable_shards
            }
            for n in TABLES
        }
        assert shards == {
            "row_a": {(8, DIM)},
            "row_b": {(5, DIM)},
            "col": {(48, 1)},
            "dat": {(12, DIM)},
            "nosparse": {(24, 1)},
        }
    finally:
        keras.distribution.set_distribution(None)
