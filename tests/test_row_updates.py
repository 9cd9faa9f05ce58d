"""dedup_and_sum: both segment algorithms against a NumPy reference."""

import keras
import numpy as np
import pytest

from keras_sparse.ops import row_updates


def _numpy_dedup(ids, valid, grads):
    uniq = np.unique(ids[valid])
    summed = np.zeros((uniq.shape[0], grads.shape[1]), np.float64)
    np.add.at(summed, np.searchsorted(uniq, ids[valid]), grads[valid])
    return uniq, summed


@pytest.fixture(params=[False, True], ids=["searchsorted", "argsort"])
def algorithm(request, monkeypatch):
    monkeypatch.setattr(row_updates, "FORCE_ARGSORT", request.param)
    return request.param


@pytest.mark.parametrize("seed", [0, 1])
def test_dedup_and_sum_matches_numpy(algorithm, seed):
    rng = np.random.default_rng(seed)
    n, num_rows = 257, 40
    ids = rng.integers(0, num_rows, n).astype("int32")
    valid = rng.random(n) > 0.2
    grads = rng.normal(size=(n, 3)).astype("float32")
    unique_ids, is_real, summed = (
        keras.ops.convert_to_numpy(t)
        for t in row_updates.dedup_and_sum(ids, valid, grads, num_rows)
    )
    ref_ids, ref_sum = _numpy_dedup(ids, valid, grads)
    k = ref_ids.shape[0]
    np.testing.assert_array_equal(is_real, np.arange(n) < k)
    np.testing.assert_array_equal(unique_ids[:k], ref_ids)
    np.testing.assert_array_equal(unique_ids[k:], num_rows)
    np.testing.assert_allclose(summed[:k], ref_sum, rtol=1e-5, atol=1e-5)


def test_training_is_the_same_with_either_algorithm(monkeypatch):
    import keras_sparse as ks

    rng = np.random.default_rng(3)
    x = rng.integers(0, 50, (128, 4)).astype("int32")
    y = rng.normal(size=(128, 1)).astype("float32")
    tables = []
    for force in (False, True):
        monkeypatch.setattr(row_updates, "FORCE_ARGSORT", force)
        keras.utils.set_random_seed(0)
        ids = keras.Input((4,), dtype="int32")
        emb = ks.AllToAllDenseEmbedding(50, 8, combiner="sum", optimizer="adam")
        model = keras.Model(ids, keras.layers.Dense(1)(emb(ids)))
        model.compile("sgd", "mse")
        before = keras.ops.convert_to_numpy(emb.embeddings)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        tables.append(keras.ops.convert_to_numpy(emb.embeddings))
        assert not np.allclose(tables[-1], before)  # it trained
        keras.backend.clear_session()
    np.testing.assert_allclose(tables[0], tables[1], rtol=1e-6, atol=1e-6)
