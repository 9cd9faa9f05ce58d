"""TensorFlow's graph-mode sparse update (tf.unique) against NumPy Adagrad."""

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tests.helpers import adagrad_case
from tests.helpers import adagrad_case_strategies
from tests.helpers import numpy_adagrad

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="TensorFlow's own update"
)


@settings(max_examples=25, deadline=None)
@given(**adagrad_case_strategies(), compiled=st.booleans())
def test_update_matches_numpy_adagrad(
    seed, n, num_rows, invalid_share, prepared, compiled
):
    import tensorflow as tf

    from keras_sparse import optimizers
    from keras_sparse.ops.tensorflow import row_updates as tf_row_updates

    table, acc, ids, valid, grads, segments = adagrad_case(
        seed, n, num_rows, invalid_share, prepared
    )
    if segments is not None:
        segments = tf.constant(segments, tf.int32)
    state = {"table": tf.Variable(table), "accumulator": tf.Variable(acc)}
    opt = optimizers.Adagrad(0.1, epsilon=1e-7)

    def step():
        assert not tf_row_updates.in_xla()
        tf_row_updates.apply_row_updates(
            state, opt, tf.constant(ids, tf.int32), tf.constant(valid),
            tf.constant(grads), tf.constant(0), num_rows, None, segments,
        )  # fmt: skip

    tf.function(step)() if compiled else step()
    ref_table, ref_acc = numpy_adagrad(table, acc, ids, valid, grads, 0.1, 1e-7)
    close = dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["table"].numpy(), ref_table, **close)
    np.testing.assert_allclose(state["accumulator"].numpy(), ref_acc, **close)


def test_xla_context_is_detected():
    import tensorflow as tf

    from keras_sparse.ops.tensorflow import row_updates as tf_row_updates

    seen = []

    def probe():
        seen.append(tf_row_updates.in_xla())
        return tf.constant(0)

    tf.function(probe, jit_compile=True)()
    tf.function(probe)()
    probe()
    assert seen == [True, False, False]
