"""The JAX dense route (whole-table update) against the sparse route."""

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse.ops import dense_row_updates

pytestmark = [
    pytest.mark.skipif(
        keras.backend.backend() != "jax", reason="the dense route is JAX's"
    ),
    pytest.mark.usefixtures("xla_route"),
]

ROWS, DIM, BAG, BATCH = 40, 3, 4, 32
# Rows the data never reaches: above USED, row 0 (masked: mask_zero with a
# combiner) and ZERO_WEIGHT_ROW (every occurrence has weight 0).
USED, ZERO_WEIGHT_ROW = 30, 7


def _optimizers():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.5)
    return {
        "sgd": lambda: ks.optimizers.SGD(0.05),
        "adagrad": lambda: ks.optimizers.Adagrad(0.1, initial_accumulator_value=0.2),
        "rowwise_adagrad": lambda: ks.optimizers.RowWiseAdagrad(0.1),
        "adam": lambda: ks.optimizers.Adam(0.01, beta_1=0.8, beta_2=0.95),
        "adam_schedule": lambda: ks.optimizers.Adam(schedule),
        "ftrl": lambda: ks.optimizers.Ftrl(
            0.1,
            l1_regularization_strength=0.01,
            l2_regularization_strength=0.01,
            l2_shrinkage_regularization_strength=0.01,
            beta=0.1,
        ),
    }


# Each step's ids come from its own window, so rows touched in one step sit
# out the next (their slots must then stay as they are, e.g. Adam's moments).
WINDOWS = ((0, 18), (12, USED), (0, 10))


def _data(seed=0):
    """Bags with many duplicates, padding (id 0) and zero weights."""
    rng = np.random.default_rng(seed)
    ids = np.concatenate(
        [rng.integers(low, high, (BATCH, BAG)) for low, high in WINDOWS]
    ).astype("int32")
    n = ids.shape[0]
    ids[:, 0] = np.where(ids[:, 0] % 2, ids[:, 0], 13)  # a hot row: duplicates
    weights = rng.uniform(0.5, 2.0, (n, BAG)).astype("float32")
    weights[ids == ZERO_WEIGHT_ROW] = 0.0
    weights[rng.random((n, BAG)) < 0.1] = 0.0
    # Row 20, trained in the second step, appears in the last with weight 0
    # only: an invalid position must not count as a touch.
    ids[-BATCH:, 1], weights[-BATCH:, 1] = 20, 0.0
    y = rng.normal(size=(n, 1)).astype("float32")
    return ids, weights, y


def _train(optimizer, dense, monkeypatch, combiner="sum"):
    monkeypatch.setattr(dense_row_updates, "FORCE_DENSE_ROUTE", dense)
    keras.utils.set_random_seed(0)
    ids_in = keras.Input((BAG,), dtype="int32")
    weights_in = keras.Input((BAG,), dtype="float32")
    layer = ks.AllToAllDenseEmbedding(
        ROWS, DIM, combiner=combiner, mask_zero=True, optimizer=optimizer
    )
    out = keras.layers.Dense(1)(layer(ids_in, weights=weights_in))
    model = keras.Model([ids_in, weights_in], out)
    model.compile("sgd", "mse")
    before = _state(layer)
    ids, weights, y = _data()
    model.fit([ids, weights], y, batch_size=BATCH, shuffle=False, verbose=0)
    return before, _state(layer)


def _state(layer):
    state = {"table": keras.ops.convert_to_numpy(layer.embeddings)}
    for name, slot in layer.slots.items():
        state[name] = keras.ops.convert_to_numpy(slot)
    state["iterations"] = int(keras.ops.convert_to_numpy(layer.sparse_iterations))
    return state


def _untouched_rows():
    ids, weights, _ = _data()
    touched = np.unique(ids[(weights != 0) & (ids != 0)])
    assert ZERO_WEIGHT_ROW not in touched and 0 not in touched
    return np.setdiff1d(np.arange(ROWS), touched)


@pytest.mark.parametrize("name", sorted(_optimizers()))
def test_dense_route_equals_the_sparse_route(name, monkeypatch):
    make = _optimizers()[name]
    before, sparse = _train(make(), False, monkeypatch)
    _, dense = _train(make(), True, monkeypatch)
    assert sorted(dense) == sorted(sparse)
    assert dense["iterations"] == sparse["iterations"] == len(WINDOWS)
    untouched = _untouched_rows()
    for key in ("table", *(k for k in dense if k not in ("table", "iterations"))):
        # Untouched rows and their slots keep their bits (lazy update).
        np.testing.assert_array_equal(dense[key][untouched], before[key][untouched])
        np.testing.assert_array_equal(sparse[key][untouched], before[key][untouched])
        # Touched rows: the same sums and element-wise math as the sparse
        # route, compiled into other loops: on XLA:CPU equal to the bit for
        # most optimizers, within an ulp for a few elements of Adam's and
        # FTRL's (the compiler's contractions differ).
        np.testing.assert_allclose(dense[key], sparse[key], rtol=1e-6, atol=1e-7)
    touched = np.setdiff1d(np.arange(ROWS), untouched)
    assert not np.allclose(dense["table"][touched], before["table"][touched])


class _ClippedAdam(ks.optimizers.Adam):
    """A user's optimizer: Adam's slots and rows, its own `update_rows`."""

    def update_rows(self, rows, slots, grads, lr, iterations):
        clipped = keras.ops.clip(grads, -1e-3, 1e-3)
        return super().update_rows(rows, slots, clipped, lr, iterations)


def test_a_subclass_update_rows_is_used_by_both_routes(monkeypatch):
    """A subclass that redefines `update_rows` keeps it on the whole-table
    route (which otherwise runs the inherited two-stage update)."""
    assert ks.optimizers.Adam().splits_update()
    assert not _ClippedAdam().splits_update()
    _, sparse = _train(_ClippedAdam(0.01), False, monkeypatch)
    _, dense = _train(_ClippedAdam(0.01), True, monkeypatch)
    _, unclipped = _train(ks.optimizers.Adam(0.01), True, monkeypatch)
    for key in ("table", "momentum", "velocity"):
        np.testing.assert_allclose(dense[key], sparse[key], rtol=1e-6, atol=1e-7)
    assert np.abs(dense["momentum"]).max() <= 1e-3 + 1e-9
    assert not np.allclose(dense["momentum"], unclipped["momentum"])


def test_mean_combiner_equal_routes(monkeypatch):
    _, sparse = _train(ks.optimizers.Adagrad(0.1), False, monkeypatch, "mean")
    _, dense = _train(ks.optimizers.Adagrad(0.1), True, monkeypatch, "mean")
    for key in ("table", "accumulator"):
        np.testing.assert_allclose(dense[key], sparse[key], rtol=1e-6, atol=1e-7)


def test_dense_updates_sum_duplicates_and_skip_invalid_positions():
    """The function alone, against NumPy: SGD makes the sums visible."""
    rng = np.random.default_rng(1)
    table = rng.normal(size=(6, 2)).astype("float32")
    ids = np.array([1, 3, 1, 5, 1, 0, 3], "int32")
    valid = np.array([True, True, True, False, True, False, True])
    grads = rng.normal(size=(7, 2)).astype("float32")
    grads[~valid] = np.nan  # must not reach any row
    out = dense_row_updates.dense_row_updates(
        ks.optimizers.SGD(0.5), {"table": table}, ids, valid, grads, 0
    )
    got = keras.ops.convert_to_numpy(out["table"])
    want = table.copy()
    np.subtract.at(want, ids[valid], 0.5 * grads[valid])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_array_equal(got[[0, 2, 4, 5]], table[[0, 2, 4, 5]])


def test_route_follows_ids_per_row():
    uses = dense_row_updates.uses_dense_route
    per_id = dense_row_updates.rows_per_id()
    rows = 8192
    assert uses(40960, rows)  # the many-fields demo: 5 ids per row
    assert uses(-(-rows // per_id), rows)
    assert not uses(rows // per_id - 1, rows)
    assert not uses(40960, rows, constraint=keras.constraints.NonNeg())


def test_distributed_steps_keep_the_sparse_route():
    distribution = keras.distribution.DataParallel()
    with distribution.scope():
        assert not dense_row_updates.uses_dense_route(40960, 8192)
    assert dense_row_updates.uses_dense_route(40960, 8192)


def _counted(monkeypatch, module, name):
    """A list that grows by one at each call of ``module.name``."""
    calls = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("rows,dense", [(64, True), (4096, False)])
def test_training_takes_the_route_its_shapes_choose(rows, dense, monkeypatch):
    """128 ids per step: the dense route for 64 rows, not for 4096 rows; the
    sparse route's dedup scratch is written only when it runs."""
    from keras_sparse.ops import row_updates

    calls = _counted(monkeypatch, dense_row_updates, "dense_row_updates")
    scratch_calls = _counted(monkeypatch, row_updates, "scratch_segments")
    ids_in = keras.Input((BAG,), dtype="int32")
    layer = ks.AllToAllDenseEmbedding(rows, DIM, combiner="sum", optimizer="adam")
    model = keras.Model(ids_in, keras.layers.Dense(1)(layer(ids_in)))
    model.compile("sgd", "mse")
    x = np.random.default_rng(0).integers(0, rows, (BATCH, BAG)).astype("int32")
    before = keras.ops.convert_to_numpy(layer.embeddings)
    model.fit(x, np.ones((BATCH, 1), "float32"), batch_size=BATCH, verbose=0)
    assert bool(calls) == dense
    assert bool(scratch_calls) != dense
    after = keras.ops.convert_to_numpy(layer.embeddings)
    touched = np.unique(x)
    np.testing.assert_array_equal(
        np.delete(after, touched, 0), np.delete(before, touched, 0)
    )
    assert not np.allclose(after[touched], before[touched])
