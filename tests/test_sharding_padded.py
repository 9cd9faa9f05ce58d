"""Row sharding with ``rows % devices != 0``: padded variables (JAX).

1001 and 13 rows on 8 devices train like one device; checkpoints hold the
unpadded tables and move 1 -> 8 -> 4 -> 1 devices.
"""

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse import sharding
from keras_sparse.sharding import keras_integration
from tests.helpers import fit_losses

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="sharding is implemented for JAX"
)

DIM, BAG, BATCH, STEPS = 8, 3, 32, 20
TABLES = {"odd": (1001, "adagrad"), "tiny": (13, "rowwise_adagrad")}


def _model():
    inputs, pooled = [], []
    for name, (rows, opt) in TABLES.items():
        x = keras.Input((BAG,), dtype="int32", name=f"{name}_ids")
        layer = ks.AllToAllDenseEmbedding(
            rows, DIM, combiner="sum", optimizer=opt, sharding="row", name=name
        )
        inputs.append(x)
        pooled.append(layer(x))
    h = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()(pooled))
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def _data(seed, steps=STEPS):
    rng = np.random.default_rng(seed)
    n = BATCH * steps
    x = []
    for rows, _ in TABLES.values():
        ids = rng.integers(0, rows, size=(n, BAG)).astype("int32")
        ids[:, 0] = rows - 1  # the last real row, next to the padding
        x.append(ids)
    return x, rng.normal(size=(n, 1)).astype("float32")


def _fit(model, x, y):
    return fit_losses(model, x, y, BATCH)


def _state(model):
    """Model weights and optimizer variables by path, tables and slots
    unpadded (weights: a one-device table's dedup scratch is step state that
    sharded tables do without, see `keras_sparse.layers.dedup_scratch`)."""
    out = {v.path: np.array(v.value) for v in model.weights}
    out.update({v.path: np.array(v.value) for v in model.optimizer.variables})
    for name in TABLES:
        layer = model.get_layer(name)
        for var in [layer.embeddings, *layer.slots.values()]:
            out[var.path] = keras_integration.unpadded_value(layer, var)
    return out


def _assert_close(got, want):
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(
            got[key], want[key], atol=1e-5, rtol=1e-5, err_msg=key
        )


def _check_layout(model, devices):
    for name, (rows, _) in TABLES.items():
        layer = model.get_layer(name)
        padded = -(-rows // devices) * devices
        for var in [layer.embeddings, *layer.slots.values()]:
            assert var.shape[0] == padded
            shards = {tuple(s.data.shape) for s in var.value.addressable_shards}
            assert shards == {(padded // devices, var.shape[1])}
            # Padding rows stay at zero: no id ever reaches them.
            np.testing.assert_array_equal(np.array(var.value)[rows:], 0)
        assert keras_integration.route(layer).strategy == "row"


# The initial checkpoint is saved before the optimizer is built.
@pytest.mark.filterwarnings("ignore:Skipping variable loading for optimizer")
def test_padded_rows_train_like_one_device_and_reshard(tmp_path):
    x, y = _data(0)
    x2, y2 = _data(1, steps=4)
    ref = _model()
    path0 = str(tmp_path / "init.keras")
    ref.save(path0)
    ref_losses = _fit(ref, x, y)
    want = _state(ref)
    assert ref.get_layer("odd").embeddings.shape == (1001, DIM)

    try:
        m8, dist8 = sharding.load_model(path0, devices=8)
        assert dist8.keras_sparse_plan["odd"].bytes_per_device == 126 * DIM * 2 * 4
        _check_layout(m8, 8)
        np.testing.assert_allclose(_fit(m8, x, y), ref_losses, atol=1e-5, rtol=1e-5)
        _check_layout(m8, 8)
        _assert_close(_state(m8), want)
        path8 = str(tmp_path / "m8.keras")
        m8.save(path8)
    finally:
        keras.distribution.set_distribution(None)

    import jax

    ref_cont = _fit(ref, x2, y2)
    want_cont = _state(ref)
    try:
        m4, _ = sharding.load_model(path8, devices=jax.devices()[:4])
        _check_layout(m4, 4)  # 1001 -> 1004 rows, 13 -> 16
        _assert_close(_state(m4), want)
        np.testing.assert_allclose(_fit(m4, x2, y2), ref_cont, atol=1e-5, rtol=1e-5)
        path4 = str(tmp_path / "m4.keras")
        m4.save(path4)
    finally:
        keras.distribution.set_distribution(None)

    m1, _ = sharding.load_model(path4, devices=1)
    assert m1.get_layer("odd").embeddings.shape == (1001, DIM)
    _assert_close(_state(m1), want_cont)


def test_padding_keeps_seeded_initial_values():
    """The real rows of a padded table start as in an unpadded build."""

    def make():
        return ks.AllToAllDenseEmbedding(
            13,
            DIM,
            embeddings_initializer=keras.initializers.RandomNormal(seed=5),
            optimizer="adagrad",
            sharding="row",
        )

    ref = make()
    ref.build()
    layer = make()
    keras.distribution.set_distribution(sharding.distribution([layer], devices=8))
    try:
        layer.build()
    finally:
        keras.distribution.set_distribution(None)
    got = np.array(layer.embeddings.value)
    assert got.shape == (16, DIM)
    np.testing.assert_allclose(got[:13], np.array(ref.embeddings.value), atol=1e-6)
    np.testing.assert_array_equal(got[13:], 0)


def test_built_uneven_table_cannot_be_padded_in_place():
    layer = ks.AllToAllDenseEmbedding(13, DIM, optimizer="adagrad", sharding="row")
    layer.build()
    with pytest.raises(ValueError, match="cannot be padded in place"):
        sharding.distribution([layer], devices=8)


def test_dense_gradient_table_needs_divisible_rows():
    layer = ks.AllToAllDenseEmbedding(13, DIM, sharding="row")
    with pytest.raises(ValueError, match="padding needs a sparse optimizer"):
        sharding.distribution([layer], devices=8)


def test_constructor_weights_are_padded_under_a_padding_plan():
    plan_layer = ks.AllToAllDenseEmbedding(
        13, DIM, optimizer="adagrad", sharding="row", name="given"
    )
    keras.distribution.set_distribution(sharding.distribution([plan_layer], devices=8))
    try:
        w = np.random.default_rng(0).normal(size=(13, DIM)).astype("float32")
        layer = ks.AllToAllDenseEmbedding(
            13, DIM, optimizer="adagrad", sharding="row", weights=w, name="given"
        )
        got = np.array(layer.embeddings.value)
    finally:
        keras.distribution.set_distribution(None)
    assert got.shape == (16, DIM)
    np.testing.assert_array_equal(got[:13], w)
    np.testing.assert_array_equal(got[13:], 0)
