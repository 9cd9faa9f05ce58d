"""TensorFlow's graph-mode sparse update (tf.unique) against NumPy Adagrad."""

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="TensorFlow's own update"
)


def _numpy_adagrad(table, acc, ids, valid, grads, lr, eps):
    table, acc = table.astype(np.float64), acc.astype(np.float64)
    summed = {}
    for i, ok, g in zip(ids, valid, grads):
        if ok:
            summed[i] = summed.get(i, 0.0) + g.astype(np.float64)
    for i, g in summed.items():
        acc[i] += g * g
        table[i] -= lr * g / np.sqrt(acc[i] + eps)
    return table, acc


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(0, 200),
    num_rows=st.integers(1, 30),
    invalid_share=st.sampled_from([0.0, 0.3, 1.0]),
    prepared=st.booleans(),
    compiled=st.booleans(),
)
def test_update_matches_numpy_adagrad(
    seed, n, num_rows, invalid_share, prepared, compiled
):
    import tensorflow as tf

    from keras_sparse import optimizers
    from keras_sparse.ops import tf_row_updates

    rng = np.random.default_rng(seed)
    table = rng.normal(size=(num_rows, 3)).astype("float32")
    acc = rng.uniform(0.1, 1.0, (num_rows, 3)).astype("float32")
    ids = rng.integers(0, num_rows, n).astype("int32")
    valid = rng.random(n) >= invalid_share
    grads = rng.normal(size=(n, 3)).astype("float32")
    segments = None
    if prepared:  # the input stage's numbering: any dense order of the keys
        keys = np.where(valid, ids, num_rows)
        number = {k: i for i, k in enumerate(rng.permutation(np.unique(keys)))}
        segments = tf.constant([number[k] for k in keys], tf.int32)
    state = {"table": tf.Variable(table), "accumulator": tf.Variable(acc)}
    opt = optimizers.Adagrad(0.1, epsilon=1e-7)

    def step():
        assert not tf_row_updates.in_xla()
        tf_row_updates.apply_row_updates(
            state, opt, tf.constant(ids, tf.int32), tf.constant(valid),
            tf.constant(grads), tf.constant(0), num_rows, None, segments,
        )  # fmt: skip

    tf.function(step)() if compiled else step()
    ref_table, ref_acc = _numpy_adagrad(table, acc, ids, valid, grads, 0.1, 1e-7)
    close = dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["table"].numpy(), ref_table, **close)
    np.testing.assert_allclose(state["accumulator"].numpy(), ref_acc, **close)


def test_xla_context_is_detected():
    import tensorflow as tf

    from keras_sparse.ops import tf_row_updates

    seen = []

    def probe():
        seen.append(tf_row_updates.in_xla())
        return tf.constant(0)

    tf.function(probe, jit_compile=True)()
    tf.function(probe)()
    probe()
    assert seen == [True, False, False]
