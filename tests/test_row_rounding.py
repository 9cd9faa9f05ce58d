"""16-bit tables: stochastic rounding of the rows a sparse optimizer writes
(`keras_sparse.ops.row_rounding`), against a NumPy model of the same bits
(tests/rounding_models.py), and the layers' ``table_dtype`` settings."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_sparse as ks
from keras_sparse.layers.arguments import ArgumentError
from keras_sparse.ops import row_rounding
from tests import rounding_models

SIXTEEN = ("bfloat16", "float16")


def _round(x, rows, step, dtype, name="table"):
    out = row_rounding.to_storage(
        ops.convert_to_tensor(np.asarray(x, np.float32)),
        dtype,
        ops.convert_to_tensor(np.asarray(rows, np.int32)),
        row_rounding.Seed(step, name),
    )
    assert row_rounding.dtype_name(out.dtype) == dtype
    return ops.convert_to_numpy(ops.cast(out, "float32"))


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_bits_match_the_numpy_model(dtype):
    rng = np.random.RandomState(0)
    scale = np.exp(rng.uniform(-6, 6, (64, 1)))
    x = (rng.randn(64, 16) * scale).astype(np.float32)
    rows = rng.randint(0, 10**6, 64)
    got = _round(x, rows, 7, dtype)
    np.testing.assert_array_equal(got, rounding_models.stochastic_round(
        x, rows, 7, "table", dtype))  # fmt: skip
    assert not np.array_equal(got, _round(x, rows, 8, dtype))  # seeded per step
    np.testing.assert_array_equal(got, _round(x, rows, 7, dtype))  # reproducible


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_unbiased_where_round_to_nearest_is_not(dtype):
    # A quarter of the way from 1.0 to the next value up.
    ulp = 2.0**-7 if dtype == "bfloat16" else 2.0**-10
    x = np.full((256, 64), 1.0 + ulp / 4, np.float32)
    draws = np.stack([_round(x, np.arange(256), step, dtype) for step in range(4)])
    # 65536 draws: the mean's standard error is 0.43 / 256 ulp.
    assert abs(draws.mean() - x[0, 0]) < 0.01 * ulp
    assert set(np.unique(draws)) == {1.0, 1.0 + ulp}
    nearest = ops.convert_to_numpy(ops.cast(ops.cast(x, dtype), "float32"))
    assert abs(nearest.mean() - x[0, 0]) == pytest.approx(ulp / 4)


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_representable_and_special_values_stay(dtype):
    x = np.array([[1.0, -0.5, 0.0, 3.0, np.inf, -np.inf, np.nan, 1024.0]], np.float32)
    got = _round(x, [5], 3, dtype)
    np.testing.assert_array_equal(got, x)


def _sum_loss(y, p):
    return ops.sum(p)


def _fit_sgd(table_dtype, stochastic=True, steps=100, rows=(0, 3), **compile_args):
    """100 SGD steps of 1e-4 on ``rows`` (gradient 1 each)."""
    layer = ks.AllToAllDenseEmbedding(
        8, 4, embeddings_initializer="ones", optimizer=ks.optimizers.SGD(1e-4),
        table_dtype=table_dtype, stochastic_rounding=stochastic,
    )  # fmt: skip
    model = keras.Sequential([keras.Input((len(rows),), dtype="int32"), layer])
    model.compile(loss=_sum_loss, optimizer="sgd", **compile_args)
    x = np.tile(np.array([rows], np.int32), (steps, 1))
    model.fit(x, np.zeros((steps, 1)), batch_size=1, epochs=1, verbose=0)
    values = ops.convert_to_numpy(ops.cast(layer.embeddings.value, "float32"))
    return layer, model, values


def _numpy_sgd(dtype, steps=100, rows=(0, 3)):
    table = np.ones((8, 4), np.float32)
    rows = np.array(rows)
    for step in range(steps):
        new = table[rows] - np.float32(1e-4) * np.float32(1.0)
        table[rows] = rounding_models.stochastic_round(new, rows, step, "table", dtype)
    return table


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_small_sgd_steps_move_a_16_bit_table(dtype):
    layer, model, values = _fit_sgd(dtype)
    assert row_rounding.dtype_name(layer.embeddings.dtype) == dtype
    assert model.predict(np.array([[0, 3]]), verbose=0).dtype == np.float32
    np.testing.assert_array_equal(values, _numpy_sgd(dtype))
    assert abs(values[[0, 3]].mean() - 0.99) < 0.004  # float32 would give 0.99
    np.testing.assert_array_equal(values[[1, 2, 4]], 1.0)  # untouched rows
    _, _, nearest = _fit_sgd(dtype, stochastic=False)
    # Round to nearest loses every step on bfloat16 (float16's ulp below
    # 1.0, 2**-11, is still above 2e-4: it loses them too).
    np.testing.assert_array_equal(nearest, 1.0)


def test_dense_route_rounds_as_the_sparse_route(monkeypatch):
    if keras.backend.backend() != "jax":
        pytest.skip("the whole-table route is JAX's")
    from keras_sparse.ops import dense_row_updates

    monkeypatch.setattr(dense_row_updates, "FORCE_DENSE_ROUTE", True)
    _, _, values = _fit_sgd("bfloat16", steps=30)
    np.testing.assert_array_equal(values, _numpy_sgd("bfloat16", steps=30))


def test_tensorflow_xla_route_rounds_alike():
    if keras.backend.backend() != "tensorflow":
        pytest.skip("TensorFlow's XLA route")
    _, _, values = _fit_sgd("bfloat16", steps=20, jit_compile=True)
    np.testing.assert_array_equal(values, _numpy_sgd("bfloat16", steps=20))


def test_row_sharded_table_rounds_as_one_device():
    if keras.backend.backend() != "jax":
        pytest.skip("keras_sparse.sharding distributions are JAX's")
    from keras_sparse import sharding

    rows = (0, 1, 2, 3, 4, 5, 6, 7)  # every shard of 8 devices owns one
    layer = ks.AllToAllDenseEmbedding(
        8, 4, embeddings_initializer="ones", optimizer=ks.optimizers.SGD(1e-4),
        table_dtype="bfloat16", sharding="row",
    )  # fmt: skip
    keras.distribution.set_distribution(sharding.distribution([layer], devices=8))
    try:
        model = keras.Sequential([keras.Input((8,), dtype="int32"), layer])
        model.compile(loss=_sum_loss, optimizer="sgd")
        x = np.tile(np.array([rows], np.int32), (64, 1))
        model.fit(x, np.zeros((64, 1)), batch_size=8, verbose=0)
        assert sharding.keras_integration.route(layer).strategy == "row"
        values = ops.convert_to_numpy(ops.cast(layer.embeddings.value, "float32"))
    finally:
        keras.distribution.set_distribution(None)
    assert row_rounding.dtype_name(layer.embeddings.dtype) == "bfloat16"
    # 8 steps, each row 8 times in the batch: a gradient of 8 per step.
    want = np.ones((8, 4), np.float32)
    for step in range(8):
        new = want - np.float32(1e-4) * np.float32(8.0)
        want = rounding_models.stochastic_round(
            new, np.arange(8), step, "table", "bfloat16"
        )
    np.testing.assert_array_equal(values, want)


def test_slots_in_16_bits_and_float32_by_default():
    layer = ks.AllToAllDenseEmbedding(8, 4, optimizer="adam", table_dtype="bfloat16")
    layer.build()
    assert [row_rounding.dtype_name(s.dtype) for s in layer.slots.values()] == [
        "float32", "float32"
    ]  # fmt: skip
    layer = ks.AllToAllDenseEmbedding(
        8, 4, optimizer="adam", table_dtype="bfloat16", slot_dtype="bfloat16"
    )
    out = layer(np.array([[1, 2]]), training=True)
    assert row_rounding.dtype_name(out.dtype) == "float32"
    assert {row_rounding.dtype_name(s.dtype) for s in layer.slots.values()} == {
        "bfloat16"
    }


def test_16_bit_slots_under_a_float32_table_train_by_fit():
    """Only the slots in 16 bits: the update rounds them (on a CPU in the
    compiled route, which serves mixed dtypes)."""
    ids = np.random.default_rng(0).integers(0, 4096, size=(64, 3))

    def fit(slot_dtype):
        keras.utils.set_random_seed(1)
        layer = ks.AllToAllDenseEmbedding(
            4096, 4, optimizer="adagrad", combiner="sum", slot_dtype=slot_dtype
        )
        inputs = keras.Input((3,), dtype="int32")
        model = keras.Model(inputs, keras.layers.Dense(1)(layer(inputs)))
        model.compile("sgd", "mse")
        model.fit(ids, np.ones((64, 1)), batch_size=16, epochs=2, verbose=0)
        return layer

    narrow, wide = fit("bfloat16"), fit(None)
    accumulator = next(iter(narrow.slots.values()))
    assert row_rounding.dtype_name(accumulator.dtype) == "bfloat16"
    assert row_rounding.dtype_name(narrow.embeddings.dtype) == "float32"
    got = ops.convert_to_numpy(narrow.embeddings.value)
    want = ops.convert_to_numpy(wide.embeddings.value)
    assert not np.array_equal(got, want)  # the slots' rounding shows
    np.testing.assert_allclose(got, want, atol=2e-2)


def test_save_and_load_keep_the_dtype(tmp_path):
    layer, model, values = _fit_sgd("bfloat16", steps=5)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path, compile=False)
    table = loaded.layers[0].embeddings
    assert row_rounding.dtype_name(table.dtype) == "bfloat16"
    assert loaded.layers[0].get_config()["table_dtype"] == "bfloat16"
    np.testing.assert_array_equal(
        ops.convert_to_numpy(ops.cast(table.value, "float32")), values
    )
    # Across dtypes: float32 weights load into a bfloat16 table by a cast
    # (to nearest); the float32 layer takes the bfloat16 values exactly.
    wide = ks.AllToAllDenseEmbedding(8, 4, optimizer=ks.optimizers.SGD(1e-4))
    wide.build()
    wide.set_weights(layer.get_weights())
    got = ops.convert_to_numpy(wide.embeddings.value)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, values)


def test_hash_layer_trains_and_saves_a_bfloat16_table(tmp_path):
    layer = ks.DistributedHashEmbedding(
        4, capacity=64, optimizer=ks.optimizers.SGD(1e-4),
        embeddings_initializer="ones", table_dtype="bfloat16",
    )  # fmt: skip
    model = keras.Sequential([keras.Input((1,), dtype="int64"), layer])
    model.compile(loss=_sum_loss, optimizer="sgd")
    x = np.full((50, 1), 12345, np.int64)
    model.fit(x, np.zeros((50, 1)), batch_size=1, verbose=0)
    assert row_rounding.dtype_name(layer.embeddings.dtype) == "bfloat16"
    records = layer.export()
    keys, vectors = records["keys"], np.asarray(records["values"], np.float32)
    assert list(keys) == [12345]
    # 50 steps of 1e-4: ~0.995 in expectation, never left at 1.0 on all 4.
    assert 0.985 < float(np.mean(vectors)) < 1.0
    path = str(tmp_path / "h.keras")
    model.save(path)
    again = keras.models.load_model(path, compile=False).layers[0]
    assert row_rounding.dtype_name(again.embeddings.dtype) == "bfloat16"
    loaded = again.export()
    assert list(loaded["keys"]) == [12345]
    np.testing.assert_array_equal(np.asarray(loaded["values"], np.float32), vectors)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"table_dtype": "float64"}, "`table_dtype` must be one of"),
        ({"slot_dtype": "half"}, "`slot_dtype` must be one of"),
        ({"stochastic_rounding": 1}, "`stochastic_rounding` must be True or False"),
    ],
)
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ArgumentError, match=match) as info:
        ks.AllToAllDenseEmbedding(8, 4, optimizer="sgd", name="emb", **kwargs)
    assert "Layer 'emb'" in str(info.value)


def test_16_bit_tables_need_a_sparse_optimizer_and_no_row_store():
    with pytest.raises(ArgumentError, match="needs a sparse `optimizer`"):
        ks.AllToAllDenseEmbedding(8, 4, table_dtype="bfloat16")
    with pytest.raises(ArgumentError, match="combined with `cache_rows`"):
        ks.AllToAllDenseEmbedding(
            8, 4, optimizer="sgd", cache_rows=4, table_dtype="bfloat16"
        )
    with pytest.raises(ArgumentError, match="Layer 'h'.*combined with `store`"):
        ks.DistributedHashEmbedding(
            4, capacity=64, store="host", slot_dtype="float16", name="h"
        )
    layer = ks.AllToAllDenseEmbedding(8, 4, table_dtype="float32")  # fine
    assert layer.get_config()["table_dtype"] == "float32"


def test_compiled_helpers_say_they_serve_16_bit_tables():
    text = ks.compiled_cpu_helpers()
    if text.startswith("on"):
        assert "bfloat16 and float16 tables and slots" in text
        assert "round stochastically" in text
