"""64-bit keys through fit/evaluate/predict on JAX without x64."""

import keras
import numpy as np
import pytest

from keras_sparse.layers import jax_full_keys
from keras_sparse.layers import jax_key_queue
from keras_sparse.layers.hash.embedding import DistributedHashEmbedding
from tests.conftest import backend

pytestmark = pytest.mark.skipif(
    backend() != "jax", reason="only JAX narrows int64 inputs to 32 bits"
)

HIGH = np.int64(2**32)


def _layer():
    return DistributedHashEmbedding(
        2,
        capacity=64,
        combiner="sum",
        optimizer="sgd",
        embeddings_initializer=keras.initializers.Constant(0.5),
    )


def _functional(layer):
    ids = keras.Input((2,), dtype="int64")
    model = keras.Model(ids, keras.layers.Dense(1, use_bias=False)(layer(ids)))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def _queued(layer):
    return len(jax_key_queue.key_queue(layer))


def test_on_batch_methods_keep_high_bits():
    layer = _layer()
    model = _functional(layer)
    x = np.array([[7, 7 + HIGH], [7 + 5 * HIGH, -7]], np.int64)
    y = np.ones((2, 1), np.float32)
    model.train_on_batch(x, y)
    assert sorted(layer.export()["keys"].tolist()) == sorted(
        {int(k) for k in x.ravel()}
    )
    # Inference: a key equal to a stored one in its low 32 bits only is unknown
    # (zeros), not the stored key's vector.
    probe = np.array([[7 + 9 * HIGH, 7 + 9 * HIGH]], np.int64)
    assert np.all(model.predict_on_batch(probe) == 0)
    assert model.test_on_batch(x, y) >= 0
    assert _queued(layer) == 0


def test_queues_are_empty_after_fit_and_predict():
    layer = _layer()
    model = _functional(layer)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 8, size=(40, 2)) + HIGH * rng.integers(0, 3, size=(40, 2))
    y = rng.normal(size=(40, 1)).astype("float32")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_split=0.2)
    model.predict(x, batch_size=16, verbose=0)
    assert _queued(layer) == 0
    assert len(layer.export()["keys"]) == len(set(x[:32].ravel().tolist()))


def test_the_build_batch_leaves_nothing_queued_during_fit():
    """Keras builds an unbuilt model from one batch of a fresh iterator; that
    batch reaches no step, so its keys must not wait in the queue (a stale
    head costs each GPU step one more check): after every step of the
    first fit, every queued batch has been taken."""
    layer = _layer()
    model = _functional(layer)
    x = (np.arange(64).reshape(32, 2) + 3 * HIGH).astype(np.int64)
    y = np.zeros((32, 1), np.float32)
    left = []

    class Queued(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            left.append(_queued(layer))

    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[Queued()])  # fmt: skip
    assert left == [0, 0, 0, 0]


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.emb = _layer()
        self.out = keras.layers.Dense(1)

    def call(self, x, training=None):
        return self.out(self.emb(x, training=training))


def test_unknown_feed_raises_for_wide_keys_and_works_for_narrow_ones():
    model = _Subclassed()
    model.compile("sgd", "mse")
    y = np.zeros((4, 1), np.float32)
    narrow = np.arange(8, dtype=np.int64).reshape(4, 2)
    model.fit(narrow, y, batch_size=4, verbose=0)
    before = sorted(model.emb.export()["keys"].tolist())
    with pytest.raises(ValueError, match="beyond the int32 range"):
        model.fit(narrow + HIGH, y, batch_size=4, verbose=0)
    assert sorted(model.emb.export()["keys"].tolist()) == before


def test_mismatched_queue_is_an_error_not_a_silent_collision():
    layer = _layer()
    layer(np.array([[1, 2]]), training=True)  # build
    jax_key_queue.key_queue(layer).append(np.array([5 + HIGH, 6], np.int64))
    with pytest.raises(jax_key_queue.KeyMismatchError, match=layer.name):
        jax_key_queue.restore(layer, np.array([1, 2], np.int64))
    jax_key_queue.key_queue(layer).clear()


@pytest.mark.parametrize(
    "inputs, data",
    [
        (lambda ids: [ids], lambda x: x),  # a bare array for a one-element list
        (lambda ids: [ids], lambda x: [x]),
        (lambda ids: {"ids": ids}, lambda x: {"ids": x}),
        (lambda ids: ids, lambda x: {"ids": x}),  # dict data keyed by name
        (lambda ids: {"g": [ids]}, lambda x: {"g": [x]}),
    ],
    ids=["list-bare", "list-list", "dict", "bare-by-name", "nested"],
)
def test_queues_the_keys_of_the_input_feeding_the_layer(inputs, data):
    layer = _layer()
    ids = keras.Input((2,), dtype="int64", name="ids")
    model = keras.Model(inputs(ids), keras.layers.Dense(1)(layer(ids)))
    x = np.array([[7 + HIGH, 8], [9, 10 + 2 * HIGH]], np.int64)
    jax_full_keys.note_batch(model, (data(x), np.zeros((2, 1))))
    assert _queued(layer) == 1
    step_keys = x.reshape(-1).astype(np.int32).astype(np.int64)  # as truncated
    np.testing.assert_array_equal(
        jax_key_queue.restore(layer, step_keys), x.reshape(-1)
    )


def test_direct_model_calls_keep_high_bits():
    """``model(x)`` with NumPy int64 keys: the functional model converts
    them to int32 before the layer runs; the layer still maps full keys."""
    layer = _layer()
    model = _functional(layer)
    x = np.array([[7, 7 + HIGH], [7 + 5 * HIGH, -7]], np.int64)
    model(x, training=True)  # eager training call: inserts the full keys
    assert sorted(layer.export()["keys"].tolist()) == sorted(
        {int(k) for k in x.ravel()}
    )
    probe = np.array([[7 + 9 * HIGH, 7 + 9 * HIGH], [7, 7 + HIGH]], np.int64)
    out = keras.ops.convert_to_numpy(model(probe, training=False))
    assert np.all(out[0] == 0)  # unknown, not key 7's vector
    assert np.all(out[1] != 0)
    assert _queued(layer) == 0


def _warnings_of(run):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if "int64" in str(w.message)]


def test_truncation_warning_only_for_inputs_keras_sparse_does_not_handle():
    x = np.array([[7, 7 + HIGH], [7 + 5 * HIGH, -7]], np.int64)
    y = np.ones((2, 1), np.float32)
    model = _functional(_layer())
    assert _warnings_of(lambda: model.fit(x, y, verbose=0)) == []
    assert _warnings_of(lambda: model.predict(x, verbose=0)) == []
    # A second int64 input read by a plain Keras layer: its values are
    # truncated for real, so JAX's warning stays.
    ids = keras.Input((2,), dtype="int64")
    other = keras.Input((2,), dtype="int64")
    plain = keras.layers.Embedding(10, 2)(other)
    hashed = _layer()(ids)
    out = keras.layers.Dense(1)(
        keras.layers.Concatenate()([hashed, keras.layers.Flatten()(plain)])
    )
    mixed = keras.Model([ids, other], out)
    mixed.compile(keras.optimizers.SGD(0.1), "mse")
    tokens = np.array([[1, 2], [3, 4]], np.int64)
    assert _warnings_of(lambda: mixed.fit([x, tokens], y, verbose=0))


def test_a_layer_queue_keeps_a_bounded_number_of_batches():
    """A hash layer pruned from the compiled step (its rows reach no result)
    never takes its queued full keys: the queue drops its oldest batches
    beyond `MAX_QUEUED_BATCHES` instead of growing for the whole fit."""

    class Field:
        name = "pruned"

    field = Field()
    queue = jax_key_queue.key_queue(field)
    batches = [
        np.full(4, i, np.int64) for i in range(jax_key_queue.MAX_QUEUED_BATCHES + 9)
    ]
    for batch in batches:
        queue.append(batch)
    assert len(queue) == jax_key_queue.MAX_QUEUED_BATCHES
    assert queue.head() is batches[9]
