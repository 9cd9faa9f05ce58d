"""Serving maps stay out of JAX training steps' state
(`keras_sparse.layers.hash.serving_state`)."""

import keras
import numpy as np
import pytest

import keras_sparse as ks

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="the JAX trainer's step state"
)

SERVING = ("serving_key_words", "serving_rows", "serving_directory", "serving_meta")


def _serving(paths):
    return [p for p in paths if p.rsplit("/", 1)[-1] in SERVING]


def _model(**kwargs):
    layers = {
        f: ks.DistributedHashEmbedding(
            4, capacity=64, optimizer="adagrad", name=f"{f}_emb", **kwargs
        )
        for f in ("a", "b")
    }
    inputs = {f: keras.Input((2,), dtype="int32", name=f) for f in layers}
    out = keras.layers.Concatenate()([layers[f](inputs[f]) for f in layers])
    model = keras.Model(inputs, keras.layers.Dense(1)(out))
    model.compile("sgd", "mse")
    return model


class _Seen(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.train, self.test = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.train.append([v.path for v in self.model.non_trainable_variables])

    def on_test_batch_end(self, batch, logs=None):
        self.test.append([v.path for v in self.model.non_trainable_variables])


def test_training_steps_leave_the_serving_maps_out_and_inference_sees_them():
    """``fit`` and ``train_on_batch`` hand no serving map through their
    steps; ``fit``'s validation, ``predict`` and the model outside any
    entry point see the maps, which give the table's rows."""
    rng = np.random.default_rng(0)
    x = {f: rng.integers(0, 40, (64, 2)).astype("int32") for f in ("a", "b")}
    y = rng.normal(size=(64, 1)).astype("float32")
    model = _model()
    everything = [v.path for v in model.non_trainable_variables]
    assert len(_serving(everything)) == 8
    seen = _Seen()
    model.fit(
        x, y, batch_size=16, epochs=2, verbose=0, validation_data=(x, y),
        callbacks=[seen],
    )  # fmt: skip
    assert seen.train and seen.test
    for paths in seen.train:
        assert _serving(paths) == [] and len(paths) == len(everything) - 8
    for paths in seen.test:
        assert len(_serving(paths)) == 8
    assert [v.path for v in model.non_trainable_variables] == everything
    model.train_on_batch({f: v[:16] for f, v in x.items()}, y[:16])
    assert [v.path for v in model.non_trainable_variables] == everything
    # The compiled prediction (serving maps, refreshed) equals an eager call
    # (the tables themselves).
    got = model.predict(x, verbose=0)
    np.testing.assert_allclose(got, model(x, training=False), rtol=1e-6, atol=1e-6)
    assert len(model.get_weights()) == len(model.weights)


def test_an_inference_call_inside_a_training_step_reads_the_table():
    """A hash layer called with ``training=False`` inside a compiled
    training step cannot read its serving map (not in the step's state): it
    maps through the table, so its rows follow the keys the same step's
    training call inserts, as in an eager run."""

    class TwoCalls(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.ids = ks.DistributedHashEmbedding(
                3,
                capacity=128,
                optimizer="sgd",
                embeddings_initializer="ones",
                key_dtype="int32",  # int32 keys: the map would serve them
                name="ids",
            )

        def call(self, x):
            trained = self.ids(x[:, :1], training=True)
            # Keys the training call inserted in earlier steps.
            looked_up = self.ids(x[:, 1:], training=False)
            return keras.ops.concatenate([trained, looked_up], axis=-1)

        def compute_output_shape(self, shape):
            return (shape[0], 6)

    def run(eager):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((2,), dtype="int32")
        model = keras.Model(inputs, keras.layers.Dense(1)(TwoCalls()(inputs)))
        model.compile("sgd", "mse", run_eagerly=eager)
        model.layers[-1].set_weights([np.full((6, 1), 0.3), np.zeros(1)])
        rng = np.random.default_rng(1)
        # Batch t trains keys 16t..16t+15 and looks up those of batch t - 1
        # (the first batch looks up keys never inserted).
        first = np.arange(96)[:, None]
        second = np.concatenate([np.arange(1000, 1016), np.arange(80)])[:, None]
        x = np.concatenate([first, second], axis=1)
        y = rng.normal(size=(96, 1)).astype("float32")
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return history.history["loss"]

    compiled, eager = run(False), run(True)
    np.testing.assert_allclose(compiled, eager, rtol=1e-5)


def test_a_failing_validation_inside_fit_leaves_the_model_whole():
    """An error raised in ``fit``'s validation (whose state holds the maps)
    reaches the caller as it is, and every variable keeps a value: ``fit``'s
    final sync puts the validation's state back through its own list."""

    class Stop(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            if batch == 1:
                raise RuntimeError("stop the validation")

    rng = np.random.default_rng(2)
    x = {f: rng.integers(0, 40, (64, 2)).astype("int32") for f in ("a", "b")}
    y = rng.normal(size=(64, 1)).astype("float32")
    model = _model()
    with pytest.raises(RuntimeError, match="stop the validation"):
        model.fit(
            x, y, batch_size=16, verbose=0, validation_data=(x, y),
            callbacks=[Stop()],
        )  # fmt: skip
    assert all(v._value is not None for v in model.variables)
    np.testing.assert_allclose(
        model.predict(x, verbose=0), model(x, training=False), rtol=1e-6, atol=1e-6
    )


def test_a_model_exported_inside_fit_serves_from_its_maps(tmp_path):
    """``model.export`` from a callback while ``fit`` runs tracks the
    serving maps (hidden from the training steps) and serves the table."""
    pytest.importorskip("tensorflow")

    class Export(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.export(str(tmp_path / "served"), verbose=False)

    rng = np.random.default_rng(4)
    x = {f: rng.integers(0, 40, (64, 2)).astype("int32") for f in ("a", "b")}
    y = rng.normal(size=(64, 1)).astype("float32")
    model = _model(key_dtype="int32")  # int32 keys: the map serves them
    model.fit(x, y, batch_size=16, verbose=0, callbacks=[Export()])
    import tensorflow as tf

    served = tf.saved_model.load(str(tmp_path / "served"))
    got = served.serve({f: tf.constant(v) for f, v in x.items()})
    np.testing.assert_allclose(np.asarray(got), model.predict(x, verbose=0), atol=1e-5)
