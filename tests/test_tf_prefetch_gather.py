"""The TensorFlow forward's prefetching gather (`tf_native_rows.gather_rows`):
the rows of ``tf.gather`` and zeros where an id is not valid, to the bit;
bad ids raise as ``tf.gather`` does; models train to the bit as with
``tf.gather``; never inside XLA."""

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tests import optimizer_models as models
from tests.optimizer_models import F

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="the TensorFlow op"
)


def _modules():
    return models.tf_op()


def _prefetch(on):
    _, tf_native_rows = _modules()
    return models.switch(tf_native_rows, "PREFETCH_GATHER", on)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(0, 300),
    rows=st.integers(1, 50),
    dim=st.sampled_from([1, 3, 16, 33]),
)
def test_rows_equal_tf_gather_and_zeros_where_not_valid(seed, n, rows, dim):
    tf, tf_native_rows = _modules()
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(rows, dim)).astype(F)
    valid = rng.random(n) < 0.8
    # Ids that are not valid may be anything: they are never read.
    ids = np.where(valid, rng.integers(0, rows, n), rng.integers(-9, rows + 9, n))
    got = tf_native_rows.gather_rows(
        tf.Variable(table), tf.constant(ids, tf.int32), tf.constant(valid)
    )
    want = np.where(valid[:, None], table[np.where(valid, ids, 0)], F(0))
    assert got.shape == (n, dim)
    np.testing.assert_array_equal(got.numpy(), want)


def test_an_id_outside_the_table_raises():
    tf, tf_native_rows = _modules()
    table = tf.Variable(np.arange(12, dtype=F).reshape(4, 3))
    for bad, position in (([1, 4, 0], 1), ([2, 0, -1], 2)):
        with pytest.raises(
            tf.errors.InvalidArgumentError,
            match=rf"id {bad[position]} at position {position} is outside the "
            r"table's rows \[0, 4\)",
        ):
            tf_native_rows.gather_rows(table, tf.constant(bad), tf.constant([True] * 3))


def test_other_dtypes_take_tf_gather():
    tf, tf_native_rows = _modules()
    table = tf.Variable(np.ones((4, 2), np.float64))
    assert (
        tf_native_rows.gather_rows(table, tf.constant([1]), tf.constant([True])) is None
    )


@pytest.mark.parametrize("form,eager", [("layers", False), ("collection", False),
                                        ("layers", True)])  # fmt: skip
def test_models_train_to_the_bit_as_with_tf_gather(form, eager, monkeypatch):
    """The forward of each step reads the rows the last step's update wrote
    (a row gather, or the pooled bags' gather and sum)."""
    _, tf_native_rows = _modules()
    rows = models.record_use(monkeypatch, tf_native_rows, "gather_rows")
    sums = models.record_use(monkeypatch, tf_native_rows, "gather_sums")
    for name in ("sgd", "adam"):
        rows.clear()
        sums.clear()
        prefetched = models.train(form, name, eager, jit_compile=False)
        assert any(rows + sums) and all(rows) and all(sums), name
        with _prefetch(False):
            reference = models.train(form, name, eager, jit_compile=False)
        for got, want in zip(prefetched, reference):
            np.testing.assert_array_equal(got, want)


def test_reads_follow_the_writes_before_them_in_one_function():
    """Ordered by the variable (a resource input): a scatter as the hash
    layers' fresh rows, then the row update, each between two gathers."""
    tf, tf_native_rows = _modules()
    from keras_sparse import optimizers

    table = tf.Variable(np.zeros((6, 2), F))
    state = {"table": table}
    ids, ok = tf.constant([1, 4]), tf.constant([True, True])

    @tf.function
    def step():
        table.assign(tf.zeros((6, 2)))
        first = tf_native_rows.gather_rows(table, ids, ok)
        table.scatter_update(tf.IndexedSlices(tf.ones((1, 2)), tf.constant([1])))
        second = tf_native_rows.gather_rows(table, ids, ok)
        tf_native_rows.fused_update(
            state, optimizers.SGD(0.5), ids, ok, tf.ones((2, 2)), tf.constant(0),
            0, 6, None,
        )  # fmt: skip
        third = tf_native_rows.gather_rows(table, ids, ok)
        return first, second, third

    for _ in range(10):
        first, second, third = (x.numpy() for x in step())
        np.testing.assert_array_equal(first, np.zeros((2, 2), F))
        np.testing.assert_array_equal(second, [[1, 1], [0, 0]])
        np.testing.assert_array_equal(third, [[0.5, 0.5], [-0.5, -0.5]])


def test_a_mirrored_variable_outside_a_replica_context_takes_tf_gather():
    tf, tf_native_rows = _modules()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        table = tf.Variable(np.ones((4, 2), F))
    assert isinstance(table, tf.distribute.DistributedValues)
    ids, ok = tf.constant([1]), tf.constant([True])
    with strategy.scope():  # cross-replica: the variable has no handle here
        assert tf.distribute.in_cross_replica_context()
        assert tf_native_rows.gather_rows(table, ids, ok) is None

    def in_replica():
        return tf_native_rows.gather_rows(table, ids, ok)

    rows = strategy.run(in_replica)
    np.testing.assert_array_equal(rows.numpy(), [[1, 1]])


def test_not_inside_xla(monkeypatch):
    _, tf_native_rows = _modules()
    calls = []
    monkeypatch.setattr(tf_native_rows, "gather_rows", lambda *a: calls.append(a))
    trained = models.train("layers", "adagrad", jit_compile=True)
    assert not calls
    with _prefetch(False):
        reference = models.train("layers", "adagrad", jit_compile=True)
    for got, want in zip(trained, reference):
        np.testing.assert_array_equal(got, want)
