"""hash_strings_tf: in-graph FNV-1a equal to the NumPy hash_strings."""

import functools

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from keras_sparse.table import hash_strings

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="TensorFlow graph ops"
)

FORBIDDEN = {"PyFunc", "PyFuncStateless", "EagerPyFunc", "NumpyFunction"}


@functools.cache
def _graph_fn():
    import tensorflow as tf

    from keras_sparse.layers.hash.tf_string_hash import hash_strings_tf

    return tf.function(
        hash_strings_tf, input_signature=[tf.TensorSpec([None, None], tf.string)]
    )


def _expected(flat, shape):
    if not flat:
        return np.zeros(shape, np.int64)
    return hash_strings(np.array(flat)).reshape(shape)


def _check_2d(flat, rows, cols):
    import tensorflow as tf

    from keras_sparse.layers.hash.tf_string_hash import hash_strings_tf

    x = tf.reshape(tf.constant(flat, tf.string, shape=[len(flat)]), [rows, cols])
    want = _expected(flat, (rows, cols))
    got = _graph_fn()(x)
    assert got.dtype == tf.int64
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(hash_strings_tf(x).numpy(), want)


def _grids(items):
    shape = st.tuples(st.integers(0, 4), st.integers(0, 4))
    return shape.flatmap(
        lambda rc: st.tuples(
            st.just(rc), st.lists(items, min_size=rc[0] * rc[1], max_size=rc[0] * rc[1])
        )
    )


@settings(max_examples=50, deadline=None)
@given(_grids(st.text(max_size=12)))
def test_text_matches_numpy(grid):
    (rows, cols), flat = grid
    _check_2d(flat, rows, cols)


@settings(max_examples=50, deadline=None)
@given(_grids(st.binary(max_size=12)))
def test_bytes_match_numpy(grid):
    # Includes embedded and trailing NULs: both sides drop the trailing ones.
    (rows, cols), flat = grid
    _check_2d(flat, rows, cols)


def test_documented_values_and_nuls():
    from keras_sparse.layers.hash.tf_string_hash import hash_strings_tf

    offset = 0xCBF29CE484222325 - 2**64
    got = hash_strings_tf(["a", "", b"a\x00", b"\x00", b"a\x00b", "é"]).numpy()
    assert got[0] == 0xAF63DC4C8601EC8C - 2**64
    assert got[1] == offset and got[3] == offset
    assert got[2] == got[0]
    assert got[4] != got[0]
    np.testing.assert_array_equal(got[4:], hash_strings([b"a\x00b", "é"]))
    assert int(hash_strings_tf("a")) == got[0]  # scalar in, scalar out


def test_graph_has_no_python_ops():
    concrete = _graph_fn().get_concrete_function()
    types = {op.type for op in concrete.graph.get_operations()}
    graph_def = concrete.graph.as_graph_def()
    for function in graph_def.library.function:  # the while loop's body
        types |= {node.op for node in function.node_def}
    assert "StringLength" in types
    assert not types & FORBIDDEN, types & FORBIDDEN


def test_saved_model_round_trip(tmp_path):
    import tensorflow as tf

    module = tf.Module()
    module.hash = _graph_fn()
    tf.saved_model.save(module, str(tmp_path))
    loaded = tf.saved_model.load(str(tmp_path))
    flat = ["a", "", "keras", "日本"]
    got = loaded.hash(tf.reshape(tf.constant(flat), [2, 2]))
    np.testing.assert_array_equal(got.numpy(), _expected(flat, (2, 2)))
