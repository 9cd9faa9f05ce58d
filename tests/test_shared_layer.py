"""One sparse layer called on two inputs in one model (a shared table).

Each call applies its own sparse update in the backward pass, one after
the other on the rows the other left; with SGD that equals Keras' summed
gradient exactly. Checked against `keras.layers.Embedding` (SGD) and a
NumPy model of the chained updates (Adagrad), the same on every backend.
"""

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse.ops import dense_row_updates

ROWS, DIM, BAG, BATCH, STEPS = 40, 8, 3, 16, 4
INIT = np.random.default_rng(1).uniform(-0.05, 0.05, (ROWS, DIM)).astype("float32")


def _data():
    rng = np.random.default_rng(0)
    n = BATCH * STEPS
    # Zipf ids: rows repeat within a call and between the two calls.
    a, b = ((rng.zipf(1.4, (n, BAG)) - 1).clip(max=ROWS - 1).astype("int32")
            for _ in range(2))  # fmt: skip
    y = rng.normal(size=(n, 1)).astype("float32")
    return a, b, y


def _table(layer):
    return next(v for v in layer.weights if tuple(v.shape) == (ROWS, DIM))


def _train(layer, optimizer):
    """Trains ``layer`` shared by inputs a and b; returns its table."""
    a_in = keras.Input((BAG,), dtype="int32", name="a")
    b_in = keras.Input((BAG,), dtype="int32", name="b")
    pooled = [keras.ops.sum(layer(x), axis=1) for x in (a_in, b_in)]
    # No trainable head: the loss is the sum of both pooled vectors.
    out = keras.ops.sum(keras.layers.Concatenate()(pooled), axis=1, keepdims=True)
    model = keras.Model([a_in, b_in], out)
    _table(layer).assign(INIT)
    model.compile(optimizer, "mse")
    a, b, y = _data()
    model.fit([a, b], y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return keras.ops.convert_to_numpy(_table(layer).value)


@pytest.fixture(params=[False, True], ids=["sparse-route", "dense-route"])
def route(request, monkeypatch):
    monkeypatch.setattr(dense_row_updates, "FORCE_DENSE_ROUTE", request.param)


def test_sgd_equals_keras_embedding(route):
    got = _train(
        ks.AllToAllDenseEmbedding(ROWS, DIM, optimizer=ks.optimizers.SGD(0.5)),
        "sgd",
    )
    want = _train(keras.layers.Embedding(ROWS, DIM), keras.optimizers.SGD(0.5))
    assert np.abs(want - INIT).max() > 1e-3  # the steps moved the table
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def _numpy_chained_adagrad(lr, eps):
    """Adagrad applied per call per step, input a's ids then b's (the
    order every backend takes; on JAX a call's update starts from the
    state the other call's update returned)."""
    table, acc = INIT.astype(np.float64), np.zeros((ROWS, DIM))
    a, b, y = _data()
    for s in range(STEPS):
        part = slice(s * BATCH, (s + 1) * BATCH)
        pred = table[a[part]].sum((1, 2)) + table[b[part]].sum((1, 2))
        dpred = 2.0 * (pred - y[part, 0]) / BATCH
        for ids in (a[part], b[part]):
            grad = np.zeros((ROWS, DIM))
            np.add.at(grad, ids.reshape(-1), np.repeat(dpred, BAG)[:, None])
            rows = np.unique(ids)
            acc[rows] += grad[rows] ** 2
            table[rows] -= lr * grad[rows] / np.sqrt(acc[rows] + eps)
    return table


def test_adagrad_chains_one_update_per_call(route):
    optimizer = ks.optimizers.Adagrad(0.1, initial_accumulator_value=0.0)
    got = _train(ks.AllToAllDenseEmbedding(ROWS, DIM, optimizer=optimizer), "sgd")
    want = _numpy_chained_adagrad(0.1, optimizer.epsilon)
    assert np.abs(want - INIT).max() > 1e-2
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="sharding is implemented for JAX"
)
@pytest.mark.parametrize("strategy", ["row", "column", "data"])
def test_sharded_shared_layer_matches_one_device(strategy):
    import jax

    from keras_sparse import sharding

    if len(jax.devices()) < 8:
        pytest.skip(
            "needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)"
        )

    def layer():
        optimizer = ks.optimizers.Adagrad(0.1, initial_accumulator_value=0.0)
        return ks.AllToAllDenseEmbedding(
            ROWS, DIM, optimizer=optimizer, sharding=strategy
        )

    want = _numpy_chained_adagrad(0.1, 1e-7)
    shared = layer()
    keras.distribution.set_distribution(sharding.distribution([shared], devices=8))
    try:
        got = _train(shared, "sgd")
    finally:
        keras.distribution.set_distribution(None)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_shared_hash_layer_matches_a_dict_model():
    # Keys far apart (any 64-bit key); rows start at zero so the result
    # does not depend on which row each key got.
    layer = ks.DistributedHashEmbedding(
        DIM, capacity=4 * ROWS, optimizer=ks.optimizers.SGD(0.05),
        embeddings_initializer="zeros", key_dtype="int32",
    )  # fmt: skip
    a_in = keras.Input((BAG,), dtype="int32", name="a")
    b_in = keras.Input((BAG,), dtype="int32", name="b")
    pooled = [keras.ops.sum(layer(x), axis=1) for x in (a_in, b_in)]
    out = keras.ops.sum(keras.layers.Concatenate()(pooled), axis=1, keepdims=True)
    model = keras.Model([a_in, b_in], out)
    model.compile("sgd", "mse")
    a, b, y = _data()
    a, b = a * 1000 + 7, b * 1000 + 7
    model.fit([a, b], y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    want = {}  # key -> row, SGD on the summed gradient of both calls
    for s in range(STEPS):
        part = slice(s * BATCH, (s + 1) * BATCH)
        value = lambda k: want.get(int(k), np.zeros(DIM))  # noqa: E731
        pred = np.array([
            sum(value(k).sum() for k in a[i]) + sum(value(k).sum() for k in b[i])
            for i in range(s * BATCH, (s + 1) * BATCH)
        ])  # fmt: skip
        dpred = 2.0 * (pred - y[part, 0]) / BATCH
        grad = {}
        for ids in (a[part], b[part]):
            for i, keys in enumerate(ids):
                for k in keys:
                    grad[int(k)] = grad.get(int(k), 0.0) + dpred[i]
        for k, g in grad.items():
            want[k] = value(k) - 0.05 * g
    keys = np.array(sorted(want), "int32")
    got = keras.ops.convert_to_numpy(layer(keys))
    assert np.abs(got).max() > 1e-3
    np.testing.assert_allclose(got, np.stack([want[int(k)] for k in keys]),
                               rtol=1e-5, atol=1e-6)  # fmt: skip


def test_collection_called_twice_chains_its_updates(route):
    optimizer = ks.optimizers.Adagrad(0.1, initial_accumulator_value=0.0)
    collection = ks.EmbeddingCollection(
        {"t": ks.TableConfig(ROWS, DIM)}, optimizer=optimizer
    )
    a_in = keras.Input((BAG,), dtype="int32", name="a")
    b_in = keras.Input((BAG,), dtype="int32", name="b")
    pooled = [keras.ops.sum(collection({"t": x})["t"], axis=1) for x in (a_in, b_in)]
    out = keras.ops.sum(keras.layers.Concatenate()(pooled), axis=1, keepdims=True)
    model = keras.Model([a_in, b_in], out)
    collection.set_table("t", INIT)
    model.compile("sgd", "mse")
    a, b, y = _data()
    model.fit([a, b], y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    want = _numpy_chained_adagrad(0.1, optimizer.epsilon)
    np.testing.assert_allclose(collection.get_table("t"), want, rtol=1e-4, atol=1e-5)
