"""Sparse optimizers against Keras optimizers and a NumPy reference."""

import keras
import numpy as np
import pytest

import keras_sparse as ks
from tests.helpers import pooled_model
from tests.helpers import random_batches

NUM_ROWS, DIM, BAG, BATCH = 24, 4, 3, 16


def _keras_optimizers():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.5)
    return {
        "sgd": lambda: keras.optimizers.SGD(0.05),
        "adagrad": lambda: keras.optimizers.Adagrad(0.1, initial_accumulator_value=0.2),
        "adam": lambda: keras.optimizers.Adam(0.01, beta_1=0.8, beta_2=0.95),
        "adam_schedule": lambda: keras.optimizers.Adam(schedule),
        "ftrl": lambda: keras.optimizers.Ftrl(
            0.1,
            l1_regularization_strength=0.01,
            l2_regularization_strength=0.01,
            l2_shrinkage_regularization_strength=0.01,
            beta=0.1,
        ),
    }


@pytest.mark.parametrize("name", sorted(_keras_optimizers()))
def test_matches_keras_optimizer_when_every_row_is_touched(name):
    """Lazy and dense updates agree when each step touches every row.

    Each batch holds every id exactly once: Keras' TensorFlow optimizers square
    IndexedSlices before summing duplicates, so duplicates are checked against
    the NumPy reference below instead.
    """
    make = _keras_optimizers()[name]
    batch = NUM_ROWS // BAG
    x, y = random_batches(NUM_ROWS, batch, BAG, steps=5, seed=1, cover_all=True)
    init = np.random.default_rng(2).normal(size=(NUM_ROWS, DIM)).astype("float32")

    ref_layer = keras.layers.Embedding(NUM_ROWS, DIM, weights=[init])
    ref = pooled_model(ref_layer, BAG)
    ref.compile(make(), "mse")
    ours_layer = ks.AllToAllDenseEmbedding(
        NUM_ROWS, DIM, weights=init, optimizer=make()
    )
    ours = pooled_model(ours_layer, BAG)
    ours.compile("sgd", "mse")

    h_ref = ref.fit(x, y, batch_size=batch, shuffle=False, verbose=0, epochs=2)
    h_ours = ours.fit(x, y, batch_size=batch, shuffle=False, verbose=0, epochs=2)
    np.testing.assert_allclose(h_ours.history["loss"], h_ref.history["loss"], rtol=2e-5)
    np.testing.assert_allclose(
        ours_layer.embeddings.numpy(),
        ref_layer.embeddings.numpy(),
        rtol=2e-5,
        atol=2e-6,
    )
    assert int(ours_layer.sparse_iterations.numpy()) == 10


def _numpy_train(kind, init, x, y, lr, steps_batches):
    """Reference: loss = mean((sum of looked-up vectors - y)^2)."""
    table = init.astype("float64").copy()
    acc_row = np.full((table.shape[0], 1), 0.1)
    m = np.zeros_like(table)
    v = np.zeros_like(table)
    for step, (xb, yb) in enumerate(steps_batches(x, y)):
        pred = table[xb].sum(axis=(1, 2))
        dpred = 2 * (pred - yb[:, 0]) / len(xb)
        grad = np.zeros_like(table)
        np.add.at(grad, xb.reshape(-1), np.repeat(dpred, xb.shape[1])[:, None])
        touched = np.unique(xb)
        g = grad[touched]
        if kind == "rowwise_adagrad":
            acc_row[touched] += np.mean(g * g, axis=1, keepdims=True)
            table[touched] -= lr * g / np.sqrt(acc_row[touched] + 1e-7)
        elif kind == "adam":
            b1, b2, t = 0.9, 0.999, step + 1
            m[touched] = b1 * m[touched] + (1 - b1) * g
            v[touched] = b2 * v[touched] + (1 - b2) * g * g
            alpha = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
            table[touched] -= alpha * m[touched] / (np.sqrt(v[touched]) + 1e-7)
    return table, m, v


@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adam"])
def test_lazy_updates_match_numpy_reference(kind):
    """Partial touches with duplicates: exact summed, lazy row updates."""
    rng = np.random.default_rng(5)
    init = rng.normal(size=(NUM_ROWS, DIM)).astype("float32")
    # Only the first 10 rows are ever used, with many duplicates per batch.
    x = rng.integers(0, 10, size=(BATCH * 4, BAG)).astype("int32")
    y = rng.normal(size=(BATCH * 4, 1)).astype("float32")
    lr = 0.05
    opt = ks.optimizers.get(kind)
    opt.learning_rate = lr
    layer = ks.AllToAllDenseEmbedding(NUM_ROWS, DIM, weights=init, optimizer=opt)
    model = pooled_model(layer, BAG)
    model.compile("sgd", "mse")
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)

    def batches(x, y):
        for i in range(0, len(x), BATCH):
            yield x[i : i + BATCH], y[i : i + BATCH]

    table, m, v = _numpy_train(kind, init, x, y, lr, batches)
    np.testing.assert_allclose(layer.embeddings.numpy(), table, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(layer.embeddings.numpy()[10:], init[10:])
    if kind == "adam":
        np.testing.assert_allclose(
            layer.slots["momentum"].numpy(), m, rtol=1e-4, atol=1e-5
        )
        assert np.all(layer.slots["velocity"].numpy()[10:] == 0)
    else:
        acc = layer.slots["accumulator"].numpy()
        assert acc.shape == (NUM_ROWS, 1)
        np.testing.assert_array_equal(
            acc[10:], np.full((NUM_ROWS - 10, 1), 0.1, "float32")
        )


def test_model_optimizer_leaves_table_alone():
    """Model optimizer with huge weight decay must not touch the table."""
    layer = ks.AllToAllDenseEmbedding(NUM_ROWS, DIM, optimizer="sgd")
    model = pooled_model(layer, BAG)
    model.compile(keras.optimizers.AdamW(0.1, weight_decay=0.9), "mse")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5, size=(BATCH, BAG)).astype("int32")
    before = layer.embeddings.numpy().copy()
    model.fit(x, np.zeros((BATCH, 1), "float32"), verbose=0)
    after = layer.embeddings.numpy()
    np.testing.assert_array_equal(after[5:], before[5:])
    assert not np.allclose(after[:5], before[:5])


def test_names_instances_and_errors():
    assert isinstance(ks.optimizers.get("adam"), ks.optimizers.Adam)
    assert isinstance(
        ks.optimizers.get("rowwise_adagrad"), ks.optimizers.RowWiseAdagrad
    )
    mirrored = ks.optimizers.get(keras.optimizers.Adam(0.3, beta_1=0.5))
    assert isinstance(mirrored, ks.optimizers.Adam)
    assert mirrored.learning_rate == pytest.approx(0.3)
    assert mirrored.beta_1 == pytest.approx(0.5)
    with pytest.raises(ValueError, match="adagrad.*adam"):
        ks.AllToAllDenseEmbedding(10, 2, optimizer="adamm")
    with pytest.raises(ValueError, match="momentum"):
        ks.optimizers.get(keras.optimizers.SGD(0.1, momentum=0.9))
    with pytest.raises(ValueError, match="no sparse counterpart"):
        ks.optimizers.get(keras.optimizers.RMSprop())
    with pytest.raises(ValueError, match="learning_rate"):
        ks.optimizers.SGD(-1.0)


def test_optimizer_config_round_trip():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    for opt in (
        ks.optimizers.Adam(schedule, beta_2=0.9),
        ks.optimizers.Ftrl(0.2, beta=0.3),
    ):
        again = ks.optimizers.deserialize(ks.optimizers.serialize(opt))
        assert type(again) is type(opt)
        assert repr(again) == repr(opt)
