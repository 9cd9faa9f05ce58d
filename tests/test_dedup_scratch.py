"""The dedup scratch: segments against NumPy, and training equal to the sort's."""

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import keras_sparse as ks
from keras_sparse.layers import dedup_scratch
from keras_sparse.ops import dense_row_updates
from keras_sparse.ops import row_updates

# The scratch belongs to XLA's route; JAX's compiled call needs none.
pytestmark = pytest.mark.usefixtures("xla_route")


@settings(max_examples=40, deadline=None)
@given(
    ids=st.lists(st.integers(0, 30), min_size=1, max_size=200),
    invalid=st.lists(st.booleans(), min_size=200, max_size=200),
    garbage=st.integers(-(2**31), 2**31 - 1),
)
def test_segments_number_the_distinct_keys_whatever_the_scratch_holds(
    ids, invalid, garbage
):
    num_rows = 31
    ids = np.array(ids, "int32")
    valid = ~np.array(invalid[: len(ids)])
    scratch = np.full((num_rows + 1,), garbage, "int32")
    written, segments = row_updates.scratch_segments(scratch, ids, valid, num_rows)
    segments = keras.ops.convert_to_numpy(segments)
    keys = np.where(valid, ids, num_rows)
    # Dense numbering 0..K-1 with equal numbers exactly for equal keys.
    assert sorted(set(segments.tolist())) == list(range(len(set(keys.tolist()))))
    same_key = keys[:, None] == keys[None, :]
    np.testing.assert_array_equal(segments[:, None] == segments[None, :], same_key)
    # A written entry holds a position of its key (not cleared: see
    # `scratch_segments`); the others keep what they held.
    written = keras.ops.convert_to_numpy(written)
    touched = np.zeros(num_rows + 1, bool)
    touched[keys] = True
    for key in np.flatnonzero(touched):
        assert keys[written[key]] == key
    np.testing.assert_array_equal(written[~touched], garbage)


def _trained(enabled, monkeypatch, collection):
    monkeypatch.setattr(dedup_scratch, "ENABLED", enabled)
    # The scratch serves the sparse route; 96 ids over 50 rows would update
    # the whole table instead (`dense_row_updates`).
    monkeypatch.setattr(dense_row_updates, "FORCE_DENSE_ROUTE", False)
    keras.utils.set_random_seed(0)
    names = ["a", "b"]
    inputs = {n: keras.Input((3,), dtype="int32", name=n) for n in names}
    if collection:
        layer = ks.EmbeddingCollection(
            {n: ks.TableConfig(50, 4, combiner="sum") for n in names},
            optimizer=ks.optimizers.Adagrad(0.1),
        )
        out = layer(inputs)
        parts = [out[n] for n in names]
    else:
        layer = ks.AllToAllDenseEmbedding(50, 4, combiner="mean", optimizer="adam")
        parts = [layer(inputs[n]) for n in names]
    model = keras.Model(
        inputs, keras.layers.Dense(1)(keras.layers.Concatenate()(parts))
    )
    model.compile("sgd", "mse")
    rng = np.random.default_rng(0)
    # Zipf: many repeats within a batch.
    x = {n: rng.zipf(1.5, (96, 3)).clip(max=50).astype("int32") - 1 for n in names}
    y = rng.normal(size=(96, 1)).astype("float32")
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    return model, layer


@pytest.mark.parametrize("collection", [False, True])
def test_training_equals_the_sort_route(monkeypatch, collection):
    with_scratch, layer = _trained(True, monkeypatch, collection)
    with_sort, _ = _trained(False, monkeypatch, collection)
    has_scratch = any("scratch" in v.path for v in layer.variables)
    assert has_scratch == (keras.backend.backend() in ("jax", "tensorflow"))
    got, want = with_scratch.get_weights(), with_sort.get_weights()
    assert len(got) == len(want)  # the scratch is not a weight
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if keras.backend.backend() == "jax":  # TF uses it under XLA only
        # The scratch route ran: its scratch holds the last batch's positions.
        scratches = [v for v in layer.variables if "scratch" in v.path]
        assert all(np.any(keras.ops.convert_to_numpy(v.value)) for v in scratches)
