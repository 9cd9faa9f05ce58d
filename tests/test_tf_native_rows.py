"""The compiled TensorFlow row-update op (keras_sparse.ops.tensorflow.native_rows):
equal to a NumPy float32 model of SGD, Adagrad, Adam and RowWiseAdagrad to
the bit, within an ulp of the graph route (to float32 rounding of
RowWiseAdagrad's mean), safe on bad ids, used only where it applies, and a
clean fallback when it cannot be built."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st

from tests import optimizer_models as models
from tests.optimizer_models import F

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="the TensorFlow op"
)


def _modules():
    return models.tf_op()


def _fused(on):
    _, tf_native_rows = _modules()
    return models.switch(tf_native_rows, "FUSED_OPTIMIZERS", on)


def _apply(
    optimizer, table, slots, ids, valid, grads, first, rows, it, constraint=None
):
    """One update of rows ``[first, first + rows)``: the op where it applies,
    else the graph route. Returns ``(state, whether the op ran)``."""
    tf, tf_native_rows = _modules()
    from keras_sparse.ops.tensorflow import row_updates as tf_row_updates

    state = {"table": tf.Variable(table)}
    state.update({k: tf.Variable(v) for k, v in slots.items()})
    op = tf_native_rows.fused_update(
        state, optimizer, tf.constant(ids, tf.int32), tf.constant(valid),
        tf.constant(grads), tf.constant(it), first, rows, constraint,
    )  # fmt: skip
    if op is None:
        tf_row_updates.apply_row_updates(
            state, optimizer, tf.constant(ids + first, tf.int32), tf.constant(valid),
            tf.constant(grads), tf.constant(it), table.shape[0], constraint, None,
        )  # fmt: skip
    return {k: v.numpy() for k, v in state.items()}, op is not None


@pytest.mark.parametrize("name", models.NAMES)
@settings(max_examples=15, deadline=None)
@models.given_updates(first=st.integers(0, 5))
def test_op_equals_numpy_and_the_graph_route(name, seed, n, rows, first, dim, it):
    optimizer = models.optimizer(name)
    rng = np.random.default_rng(seed)
    table, slots = models.random_state(optimizer, rng, first + rows + 2, dim)
    ids, valid, grads = models.random_batch(rng, rows, n, dim)
    args = (ids, valid, grads, first, rows, it)
    got, fused = _apply(optimizer, table, slots, *args)
    assert fused
    want = models.numpy_update(
        name, optimizer, table, slots, ids, valid, grads, it, first
    )
    with _fused(False):
        graph, fused = _apply(optimizer, table, slots, *args)
    assert not fused
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        np.testing.assert_allclose(
            got[key], graph[key], rtol=2e-6, atol=models.route_atol(name)
        )


@pytest.mark.parametrize("name", ["rowwise_adagrad", "ftrl_power"])
def test_several_steps_with_duplicates(name):
    def apply(optimizer, table, slots, ids, valid, grads, it):
        state, fused = _apply(
            optimizer, table, slots, ids, valid, grads, 0, table.shape[0], it
        )
        assert fused
        return state

    models.check_several_steps(apply, name)


def test_an_id_outside_the_rows_raises_and_changes_nothing():
    tf, tf_native_rows = _modules()
    from keras_sparse import optimizers

    table = tf.Variable(np.arange(24, dtype=F).reshape(8, 3))
    acc = tf.Variable(np.ones((8, 3), F))
    state = {"table": table, "accumulator": acc}
    for bad in ([1, 4], [1, -1]):
        with pytest.raises(tf.errors.InvalidArgumentError, match="outside"):
            tf_native_rows.fused_update(
                state, optimizers.Adagrad(0.1), tf.constant(bad),
                tf.constant([True] * 2), tf.ones((2, 3)), tf.constant(0), 2, 4, None,
            )  # fmt: skip
    np.testing.assert_array_equal(table.numpy(), np.arange(24, dtype=F).reshape(8, 3))
    np.testing.assert_array_equal(acc.numpy(), np.ones((8, 3), F))


def test_subclasses_constraints_and_other_optimizers_take_the_graph_route():
    cases, (ids, valid, grads) = models.route_cases()
    grads = grads * 5
    rng = np.random.default_rng(0)
    for optimizer, constraint, expect_fused in cases:
        table, slots = models.random_state(optimizer, rng, 4, 4)
        _, fused = _apply(
            optimizer, table, slots, ids, valid, grads, 0, 4, 0, constraint
        )
        assert fused == expect_fused, optimizer


@pytest.mark.parametrize("form,eager", [("layers", False), ("collection", False),
                                        ("layers", True)])  # fmt: skip
def test_models_train_alike_on_both_routes(form, eager, monkeypatch):
    _, tf_native_rows = _modules()
    built = models.record_use(monkeypatch, tf_native_rows, "fused_update")
    for name in models.TRAINED:
        built.clear()
        fused = models.train(form, name, eager)
        assert built and all(built), name  # every table's update is the op
        with _fused(False):
            reference = models.train(form, name)
        for got, want in zip(fused, reference):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_without_a_compiler_the_graph_route_runs(tmp_path):
    code = (
        "from keras_sparse.ops.tensorflow import native_rows as t;"
        "print(t.library() is None);print(t.status())"
    )
    env = {**os.environ, "KERAS_SPARSE_CACHE": str(tmp_path), "CXX": "no-such-cxx"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    none, status = result.stdout.strip().splitlines()[-2:]
    assert none == "True"
    assert status == "off: no C compiler found ($CXX or c++)"


def test_the_helpers_list_every_compiled_optimizer():
    import keras_sparse as ks

    _modules()  # skips where the compiled code cannot be built
    text = ks.compiled_cpu_helpers()
    assert text.startswith("on: ")
    assert "; optimizers: SGD, Adagrad, Adam, RowWiseAdagrad, Ftrl; " in text
