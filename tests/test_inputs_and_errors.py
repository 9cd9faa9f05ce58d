"""Input forms (padded, ragged, sparse), combiner edge cases and bad input."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_sparse as ks
from tests.helpers import pooled_model

BACKEND = keras.backend.backend()


def _table(rows=12, dim=3):
    return np.random.default_rng(0).normal(size=(rows, dim)).astype("float32")


def _numpy_pool(table, rows_of_ids, combiner, weights=None):
    out = []
    for i, ids in enumerate(rows_of_ids):
        w = np.ones(len(ids)) if weights is None else np.asarray(weights[i])
        vecs = (
            table[np.asarray(ids, int)] if len(ids) else np.zeros((0, table.shape[1]))
        )
        total = (vecs * w[:, None]).sum(0)
        if combiner == "mean" and len(ids):
            total = total / w.sum()
        if combiner == "sqrtn" and len(ids):
            total = total / np.sqrt((w**2).sum())
        out.append(total)
    return np.stack(out)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_padded_form_excludes_padding_and_empty_bag_is_zero(combiner):
    table = _table()
    bags = [[3, 1], [], [4, 1, 5]]
    ids, weights = ks.ragged_to_padded(np.array([3, 1, 4, 1, 5]), [2, 0, 3])
    layer = ks.AllToAllDenseEmbedding(12, 3, weights=table, combiner=combiner)
    out = ops.convert_to_numpy(layer(ids, weights=weights))
    np.testing.assert_allclose(out, _numpy_pool(table, bags, combiner), atol=1e-6)
    assert np.all(out[1] == 0)


def test_mask_zero_excluded_from_pooling():
    table = _table()
    layer = ks.AllToAllDenseEmbedding(
        12, 3, weights=table, combiner="mean", mask_zero=True
    )
    out = ops.convert_to_numpy(layer(np.array([[0, 2, 0], [0, 0, 0]])))
    np.testing.assert_allclose(out[0], table[2], atol=1e-6)
    np.testing.assert_array_equal(out[1], np.zeros(3))


def test_per_id_weights_with_1d_ids_and_combiner():
    table = _table()
    layer = ks.AllToAllDenseEmbedding(12, 3, weights=table, combiner="sum")
    out = ops.convert_to_numpy(layer(np.array([1, 2]), weights=np.array([2.0, 0.5])))
    np.testing.assert_allclose(out, table[[1, 2]] * np.array([[2.0], [0.5]]), atol=1e-6)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.RaggedTensor/SparseTensor")
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_tf_ragged_and_sparse_inputs(combiner):
    import tensorflow as tf

    table = _table()
    bags = [[3, 1], [], [4, 1, 5]]
    layer = ks.AllToAllDenseEmbedding(12, 3, weights=table, combiner=combiner)
    expected = _numpy_pool(table, bags, combiner)
    ragged = tf.ragged.constant(bags, dtype=tf.int64)
    np.testing.assert_allclose(layer(ragged).numpy(), expected, atol=1e-6)
    sparse = ragged.to_sparse()
    np.testing.assert_allclose(layer(sparse).numpy(), expected, atol=1e-6)
    weights = tf.ragged.constant([[2.0, 1.0], [], [1.0, 0.5, 3.0]])
    np.testing.assert_allclose(
        layer(ragged, weights=weights).numpy(),
        _numpy_pool(table, bags, combiner, [[2, 1], [], [1, 0.5, 3]]),
        atol=1e-5,
    )


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.RaggedTensor")
@pytest.mark.parametrize("optimizer", [None, "sgd"])
def test_tf_ragged_without_combiner_stays_ragged(optimizer):
    import tensorflow as tf

    table = _table()
    bags = [[3, 1], [], [4, 1, 5]]
    layer = ks.AllToAllDenseEmbedding(12, 3, weights=table, optimizer=optimizer)
    ragged = tf.ragged.constant(bags, dtype=tf.int64)
    weights = tf.ragged.constant([[2.0, 1.0], [], [1.0, 0.5, 3.0]])
    out = layer(ragged, weights=weights)
    assert isinstance(out, tf.RaggedTensor)
    np.testing.assert_array_equal(out.row_lengths().numpy(), [2, 0, 3])
    flat_w = np.array([2.0, 1.0, 1.0, 0.5, 3.0], "float32")[:, None]
    np.testing.assert_allclose(
        out.flat_values.numpy(), table[[3, 1, 4, 1, 5]] * flat_w, atol=1e-6
    )


@pytest.mark.skipif(BACKEND != "jax", reason="jax.experimental.sparse.BCOO")
@pytest.mark.parametrize("combiner", [None, "sum", "mean", "sqrtn"])
def test_jax_bcoo_ids_with_every_combiner(combiner):
    from jax.experimental import sparse as jax_sparse

    table = _table()
    bags = [[3, 1], [], [4, 1, 5]]
    ids, weights = ks.ragged_to_padded(np.array([3, 1, 4, 1, 5]), [2, 0, 3])
    coords = np.argwhere(weights > 0)
    bcoo = jax_sparse.BCOO((ids[weights > 0], coords), shape=ids.shape)
    layer = ks.AllToAllDenseEmbedding(12, 3, weights=table, combiner=combiner)
    out = ops.convert_to_numpy(layer(bcoo))
    if combiner is None:  # gaps read zeros, as keras.layers.Embedding
        expected = table[ids] * weights[..., None]
    else:
        expected = _numpy_pool(table, bags, combiner)
    np.testing.assert_allclose(out, expected, atol=1e-6)


def test_padding_is_not_updated_by_sparse_optimizer():
    table = _table()
    layer = ks.AllToAllDenseEmbedding(
        12, 3, weights=table, combiner="sum", optimizer="adam"
    )
    ids = keras.Input((3,), dtype="int32")
    w = keras.Input((3,))
    model = keras.Model([ids, w], layer(ids, weights=w))
    model.compile("sgd", "mse")
    x, wx = ks.ragged_to_padded(np.array([3, 1, 4, 1, 5, 6]), [2, 1, 3], max_length=3)
    model.fit([x, wx], np.ones((3, 3), "float32"), verbose=0)
    after = layer.embeddings.numpy()
    np.testing.assert_array_equal(after[0], table[0])  # pad id, weight 0
    changed = np.where(np.any(after != table, axis=1))[0].tolist()
    assert changed == [1, 3, 4, 5, 6]


def test_float_ids_cast_like_keras_and_non_integral_ones_raise():
    table = _table()
    layer = ks.AllToAllDenseEmbedding(12, 3, weights=table, name="emb_f")
    reference = keras.layers.Embedding(12, 3, weights=table)
    ids = np.array([[1.0, 2.0], [11.0, 0.0]], "float32")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(layer(ids)),
        keras.ops.convert_to_numpy(reference(ids)),
    )
    with pytest.raises(ValueError, match=r"emb_f.*2\.5.*not an integer"):
        layer(np.array([[1.0, 2.5]]))


def test_out_of_range_eager_raises_and_leaves_state():
    layer = ks.AllToAllDenseEmbedding(10, 2, name="emb_r", optimizer="adam")
    layer.build()
    before = layer.embeddings.numpy().copy()
    for bad in (10, -1):
        with pytest.raises(ValueError, match=rf"emb_r.*{bad}.*\[0, 10\)"):
            layer(np.array([[1, bad, 3]]), training=True)
    np.testing.assert_array_equal(layer.embeddings.numpy(), before)
    assert int(layer.sparse_iterations.numpy()) == 0


@pytest.mark.skipif(BACKEND == "torch", reason="torch fit runs eagerly and raises")
def test_invalid_ids_in_compiled_step_read_zero_and_update_nothing():
    table = _table()
    layer = ks.AllToAllDenseEmbedding(12, 3, weights=table, optimizer="sgd")
    model = pooled_model(layer, 2)
    model.compile("sgd", "mse", jit_compile=BACKEND == "jax")
    x = np.array([[1, 99], [-5, 2], [1000, 12]], "int32")
    pred = model.predict(x, verbose=0)
    np.testing.assert_allclose(
        pred[:, 0], [table[1].sum(), table[2].sum(), 0.0], atol=1e-5
    )
    model.fit(x, np.ones((3, 1), "float32"), verbose=0)
    after = layer.embeddings.numpy()
    changed = np.where(np.any(after != table, axis=1))[0].tolist()
    assert changed == [1, 2]


def test_argument_errors_list_choices():
    with pytest.raises(ValueError, match="'sum', 'mean', 'sqrtn'"):
        ks.AllToAllDenseEmbedding(10, 2, combiner="avg")
    with pytest.raises(ValueError, match="input_dim"):
        ks.AllToAllDenseEmbedding(0, 2)
    with pytest.raises(ValueError, match="emb_l.*`lora_rank`=4 needs optimizer=None"):
        ks.AllToAllDenseEmbedding(10, 2, lora_rank=4, optimizer="sgd", name="emb_l")
    layer = ks.AllToAllDenseEmbedding(10, 2, optimizer="adam", name="emb_q")
    layer.build()
    with pytest.raises(ValueError, match="emb_q.*`lora_rank`=2 needs"):
        layer.enable_lora(2)
    with pytest.raises(ValueError, match="sharding"):
        ks.AllToAllDenseEmbedding(10, 2, sharding="rows")
    with pytest.raises(ValueError, match="weights"):
        ks.AllToAllDenseEmbedding(10, 2, weights=np.zeros((3, 2)))


def test_wide_int64_ids_raise_with_the_id_as_passed():
    """int64 ids past int32 raise before any conversion (JAX would wrap
    2**32 + 5 to row 5) and leave the table alone."""
    layer = ks.AllToAllDenseEmbedding(10, 2, name="emb_w", optimizer="sgd")
    layer.build()
    before = ops.convert_to_numpy(layer.embeddings).copy()
    wide = 2**32 + 5
    with pytest.raises(ValueError, match=rf"emb_w.*id {wide} is out of range"):
        layer(np.array([[1, wide]], "int64"), training=True)
    with pytest.raises(ValueError, match=rf"id {2**63 + 3} is out of range"):
        layer(np.array([[1, 2**63 + 3]], "uint64"))
    np.testing.assert_array_equal(ops.convert_to_numpy(layer.embeddings), before)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX without x64 wraps int64 ids")
@pytest.mark.parametrize("kind", ["layer", "collection"])
def test_wide_int64_ids_never_train_a_wrapped_row_in_fit(kind):
    """fit/predict refuse int64 ids past int32 before any step: JAX would
    hand the step 2**32 + 5 as 5 and train row 5."""
    ids = keras.Input((2,), dtype="int64", name="ids")
    if kind == "layer":
        emb = ks.AllToAllDenseEmbedding(10, 2, optimizer="sgd", name="emb_w")
        out = emb(ids)
    else:
        emb = ks.EmbeddingCollection(
            {"t": ks.TableConfig(10, 2)}, optimizer="sgd", name="emb_w"
        )
        out = emb({"t": ids})["t"]
    model = keras.Model(ids, keras.layers.Flatten()(out))
    model.compile("sgd", "mse")
    model.build((None, 2))
    before = [np.array(w) for w in model.get_weights()]
    x = np.array([[1, 2**32 + 5], [3, 4]], "int64")
    y = np.ones((2, 4), "float32")
    with pytest.raises(ValueError, match=rf"id {2**32 + 5}.*emb_w.*wrap it to 5"):
        model.fit(x, y, verbose=0)
    with pytest.raises(ValueError, match=rf"id {2**32 + 5}"):
        model.fit(
            _batches(x, y), steps_per_epoch=1, verbose=0
        )  # batches from a generator are checked one by one
    for old, new in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(old, new)
    # In range, int64 ids train as usual.
    model.fit(np.array([[1, 2], [3, 4]], "int64"), y, verbose=0)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX without x64 wraps int64 ids")
def test_wide_int64_inputs_of_other_layers_are_left_alone():
    ids = keras.Input((2,), dtype="int32", name="ids")
    stamp = keras.Input((1,), dtype="int64", name="stamp")
    emb = keras.layers.Flatten()(ks.AllToAllDenseEmbedding(10, 2)(ids))
    extra = keras.layers.Lambda(lambda t: keras.ops.cast(t, "float32") * 0)(stamp)
    model = keras.Model([ids, stamp], keras.layers.Concatenate()([emb, extra]))
    model.compile("sgd", "mse")
    x = [np.array([[1, 2]], "int32"), np.array([[2**40]], "int64")]
    model.fit(x, np.ones((1, 5), "float32"), verbose=0)


def _batches(x, y):
    while True:
        yield x, y
