"""Sparse-update math: every segment algorithm and size against NumPy."""

import keras
import numpy as np
import pytest

from keras_sparse import optimizers
from keras_sparse.ops import count_buckets
from keras_sparse.ops import dense_row_updates
from keras_sparse.ops import row_updates


def _numpy_dedup(ids, valid, grads):
    uniq = np.unique(ids[valid])
    summed = np.zeros((uniq.shape[0], grads.shape[1]), np.float64)
    np.add.at(summed, np.searchsorted(uniq, ids[valid]), grads[valid])
    return uniq, summed


@pytest.fixture(params=row_updates.SEGMENT_ALGORITHMS)
def algorithm(request, monkeypatch):
    monkeypatch.setattr(row_updates, "FORCE_SEGMENT_ALGORITHM", request.param)
    return request.param


@pytest.mark.parametrize("seed", [0, 1])
def test_dedup_and_sum_matches_numpy(algorithm, seed):
    rng = np.random.default_rng(seed)
    n, num_rows = 257, 40
    ids = rng.integers(0, num_rows, n).astype("int32")
    valid = rng.random(n) > 0.2
    grads = rng.normal(size=(n, 3)).astype("float32")
    _check_dedup_and_sum(ids, valid, grads, num_rows)


def _check_dedup_and_sum(ids, valid, grads, num_rows):
    n = ids.shape[0]
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


def test_packing_needs_id_and_position_bits_within_the_word():
    # ids run to num_rows (the invalid sentinel), positions to n - 1.
    fits = row_updates.packs_into_word
    assert fits(2**14, 2**17 - 1, bits=31)  # 17 + 14 bits
    assert not fits(2**14, 2**17, bits=31)  # 18 + 14 bits
    assert fits(2**14, 2**17, bits=32)
    assert not fits(2**14 + 1, 2**17, bits=32)  # 18 + 15
    assert fits(1, 2**30 - 1, bits=31)


def test_packed_falls_back_to_search_when_the_bits_do_not_fit(monkeypatch):
    monkeypatch.setattr(row_updates, "FORCE_SEGMENT_ALGORITHM", "packed")
    rng = np.random.default_rng(5)
    n, num_rows = 300, 2**23 + 7  # 24 + 9 bits: packing would overflow 32
    ids = rng.integers(num_rows - 50, num_rows, n).astype("int32")
    valid = np.ones(n, bool)
    grads = rng.normal(size=(n, 2)).astype("float32")
    _check_dedup_and_sum(ids, valid, grads, num_rows)


def _given_segments(ids, valid, how, rng):
    """Segment per position computed outside the step: sorted or shuffled."""
    if how is None:
        return None
    keys = np.where(valid, ids, np.iinfo(np.int32).max)
    _, inverse = np.unique(keys, return_inverse=True)
    if how == "shuffled":  # any dense numbering will do
        inverse = rng.permutation(inverse.max() + 1)[inverse]
    return inverse.astype("int32")


SEGMENT_SOURCES = [(a, None) for a in row_updates.SEGMENT_ALGORITHMS] + [
    (None, "sorted"),
    (None, "shuffled"),
]


@pytest.mark.parametrize("algorithm,given", SEGMENT_SOURCES)
@pytest.mark.parametrize("sized", [False, True], ids=["n_rows", "sized"])
@pytest.mark.parametrize("distinct", [3, 8, 9, 40, 129, 400])
def test_row_updates_match_numpy_adagrad_for_every_bucket(
    algorithm, given, sized, distinct, monkeypatch
):
    """Counts on both sides of each bucket edge (n=512: 16, 64, 256, 512),
    with segments found in the step (each algorithm) or given (as the input
    stage does)."""
    monkeypatch.setattr(row_updates, "FORCE_SEGMENT_ALGORITHM", algorithm)
    monkeypatch.setattr(count_buckets, "FORCE_SIZED", sized)
    rng = np.random.default_rng(distinct)
    n, num_rows, dim = 512, 1000, 4
    pool = rng.choice(num_rows, size=distinct, replace=False)
    ids = np.concatenate([pool, rng.choice(pool, n - distinct)])
    ids = rng.permutation(ids).astype("int32")
    valid = rng.random(n) > 0.1
    valid[: distinct // 2] = True
    grads = rng.normal(size=(n, dim)).astype("float32")
    table = rng.normal(size=(num_rows, dim)).astype("float32")
    acc = np.full((num_rows, dim), 0.1, "float32")
    state = {"table": table, "accumulator": acc}
    opt = optimizers.Adagrad(0.5)
    unique_ids, is_real, new_values = row_updates.compute_row_updates(
        opt,
        lambda name, rows: keras.ops.take(state[name], rows, axis=0),
        ("accumulator",),
        ids,
        valid,
        grads,
        0,
        num_rows,
        segments=_given_segments(ids, valid, given, rng),
    )
    unique_ids, is_real = (keras.ops.convert_to_numpy(t) for t in (unique_ids, is_real))
    new = {k: keras.ops.convert_to_numpy(v) for k, v in new_values.items()}
    assert unique_ids.shape == (n,) and new["table"].shape == (n, dim)
    ref_ids, ref_sum = _numpy_dedup(ids, valid, grads)
    k = ref_ids.shape[0]
    # Real entries: the distinct valid ids, in the numbering's order.
    assert not is_real[k + 1 :].any() and is_real.sum() == k
    np.testing.assert_array_equal(unique_ids[~is_real], num_rows)
    got_ids = unique_ids[is_real]
    order = np.argsort(got_ids)
    np.testing.assert_array_equal(got_ids[order], ref_ids)
    if given != "shuffled":
        np.testing.assert_array_equal(is_real, np.arange(n) < k)
    ref_acc = acc[ref_ids] + ref_sum**2
    ref_rows = table[ref_ids] - 0.5 * ref_sum / np.sqrt(ref_acc + 1e-7)
    got_acc = new["accumulator"][is_real][order]
    got_rows = new["table"][is_real][order]
    np.testing.assert_allclose(got_acc, ref_acc, rtol=1e-5)
    np.testing.assert_allclose(got_rows, ref_rows, rtol=1e-5, atol=1e-6)


def test_training_is_the_same_with_every_algorithm_and_size(monkeypatch):
    import keras_sparse as ks

    rng = np.random.default_rng(3)
    x = rng.integers(0, 50, (128, 4)).astype("int32")
    y = rng.normal(size=(128, 1)).astype("float32")
    # 64 ids per step over 50 rows would take the dense route (no segments).
    monkeypatch.setattr(dense_row_updates, "FORCE_DENSE_ROUTE", False)
    tables = []
    for algorithm in row_updates.SEGMENT_ALGORITHMS:
        for sized in (False, True):
            monkeypatch.setattr(row_updates, "FORCE_SEGMENT_ALGORITHM", algorithm)
            monkeypatch.setattr(count_buckets, "FORCE_SIZED", sized)
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
    for other in tables[1:]:
        np.testing.assert_allclose(tables[0], other, rtol=1e-6, atol=1e-6)
