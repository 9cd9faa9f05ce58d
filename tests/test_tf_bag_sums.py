"""TensorFlow's pooled bags (`keras_sparse.ops.tensorflow.lookup.
bag_sums_with_sparse_update`): the sum of each bag's rows and the update from
the bags' pooled gradients, never expanded to one row per position, equal
the lookup and the sum combiner's route to the bit."""

import keras
import ml_dtypes
import numpy as np
import pytest

from tests import optimizer_models as models

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="the TensorFlow route"
)


@pytest.mark.parametrize("name", ["rowwise_adagrad", "ftrl"])
@pytest.mark.parametrize("table_dtype", ["float32", "bfloat16"])
def test_the_op_reads_a_bags_gradient_at_each_of_its_positions(name, table_dtype):
    tf, tf_native_rows = models.tf_op()
    opt = models.optimizer(name)
    rng = np.random.default_rng(5)
    table, slots = models.random_state(opt, rng, 30, 3)
    table = table.astype(ml_dtypes.bfloat16 if table_dtype == "bfloat16" else "f4")
    ids, valid, _ = models.random_batch(rng, 20, 36, 3)  # 12 bags of 3
    pooled = rng.normal(size=(12, 3)).astype("f4")
    got = []
    for bag, grads in ((3, pooled), (1, np.repeat(pooled, 3, axis=0))):
        state = {
            "table": tf.Variable(table),
            **{k: tf.Variable(v) for k, v in slots.items()},
        }
        ran = tf_native_rows.fused_update(
            state, opt, tf.constant(ids, tf.int32), tf.constant(valid),
            tf.constant(grads), tf.constant(4, tf.int64), 5, 20, None, bag=bag,
        )  # fmt: skip
        assert ran is not None
        got.append({k: v.numpy() for k, v in state.items()})
    assert not np.array_equal(got[0]["table"], table)  # rows did change
    for key in got[1]:
        np.testing.assert_array_equal(got[0][key], got[1][key], err_msg=key)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"\[n / bag, dim\]"):
        tf_native_rows.fused_update(
            state, opt, tf.constant(ids, tf.int32), tf.constant(valid),
            tf.constant(pooled), tf.constant(4, tf.int64), 5, 20, None, bag=2,
        )  # fmt: skip


def test_gathered_sums_add_as_tensorflows_reduce_sum():
    """The fused gather-and-sum equals tf.reduce_sum of the gathered bags to
    the bit (signs of zeros too) for every bag it serves, on the installed
    TensorFlow; padded positions add nothing; bad ids raise."""
    tf, tf_native_rows = models.tf_op()
    rng = np.random.default_rng(0)
    for dim in (1, 3, 16):
        scale = np.exp(rng.normal(size=(50, 1)) * 5)
        table = tf.Variable((rng.normal(size=(50, dim)) * scale).astype("f4"))
        for bag in range(1, tf_native_rows.GATHER_SUMS_MAX_BAG + 1):
            ids = rng.integers(0, 50, 23 * bag).astype("i4")
            valid = rng.random(23 * bag) > 0.2
            got = tf_native_rows.gather_sums(table, ids, valid, bag).numpy()
            rows = tf.where(valid[:, None], tf.gather(table, ids), 0.0)
            want = tf.reduce_sum(tf.reshape(rows, [-1, bag, dim]), 1).numpy()
            np.testing.assert_array_equal(got, want)
            assert np.array_equal(np.signbit(got), np.signbit(want))
    big = tf_native_rows.GATHER_SUMS_MAX_BAG + 1
    assert tf_native_rows.gather_sums(table, ids[:big], valid[:big], big) is None
    with pytest.raises(tf.errors.InvalidArgumentError, match="id 50 at position 1"):
        tf_native_rows.gather_sums(table, [3, 50], [True, True], 2)


def _train(form, bags):
    """Trains a small model (sum, mean, masked, constrained and 16-bit-slot
    tables; 3 ids per bag) for 6 steps in a compiled step; its weights."""
    import keras_sparse as ks
    from keras_sparse.ops.tensorflow import lookup as tf_lookup

    tf_lookup.BAG_SUMS = bags
    keras.utils.set_random_seed(3)
    names = ("a", "b", "c", "d")
    inputs = {n: keras.Input((3,), dtype="int32", name=n) for n in names}
    opt = ks.optimizers.RowWiseAdagrad(0.1, initial_accumulator_value=0.1)
    if form == "layers":
        options = {
            "a": dict(optimizer=models.optimizer("ftrl"), mask_zero=True),
            "b": dict(combiner="mean", optimizer="adagrad"),
            "c": dict(optimizer=opt, embeddings_constraint="max_norm"),
            "d": dict(optimizer="adam", slot_dtype="bfloat16"),
        }
        parts = [
            ks.AllToAllDenseEmbedding(
                40, 4, name=f"t_{n}", **{"combiner": "sum", **options[n]}
            )(x)
            for n, x in inputs.items()
        ]
    else:
        collection = ks.EmbeddingCollection(
            {n: ks.TableConfig(30 + 5 * i, 4, combiner="sum")
             for i, n in enumerate(names)},
            optimizer=opt,
        )  # fmt: skip
        outputs = collection(inputs)
        parts = [outputs[n] for n in names]
    model = keras.Model(
        inputs, keras.layers.Dense(1)(keras.layers.Concatenate()(parts))
    )
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = {n: rng.integers(0, 30, (48, 3)).astype("int32") for n in names}
    x["a"][::4, 1] = 0  # masked positions
    model.fit(x, rng.normal(size=(48, 1)), batch_size=8, verbose=0, shuffle=False)
    tf_lookup.BAG_SUMS = True
    return [np.array(v) for v in model.weights]


@pytest.mark.parametrize("form", ["layers", "collection"])
def test_pooled_bags_train_as_the_lookup_and_the_sum_combiner(form, monkeypatch):
    from keras_sparse.ops.tensorflow import lookup as tf_lookup

    models.tf_op()
    real = tf_lookup.bag_sums_with_sparse_update
    served = []

    def record(state, *args, **kwargs):
        served.append(state.table_var.path)
        return real(state, *args, **kwargs)

    monkeypatch.setattr(tf_lookup, "bag_sums_with_sparse_update", record)
    got = _train(form, True)
    if form == "layers":  # every sum table; the mean one (traced) not
        assert sorted({p.split("/")[0] for p in served}) == ["t_a", "t_c", "t_d"]
    else:
        assert served
    served.clear()
    want = _train(form, False)
    assert not served
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
