"""model.fit/evaluate/predict in every model style; save/load continues exactly."""

import keras
import numpy as np
import pytest

import keras_sparse as ks

BACKEND = keras.backend.backend()
ROWS, DIM, BAG = 30, 4, 3


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, ROWS, size=(n, BAG)).astype("int32")
    y = rng.normal(size=(n, 1)).astype("float32")
    return x, y


def _init():
    return np.random.default_rng(7).normal(size=(ROWS, DIM)).astype("float32")


def _dense():
    return keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="zeros")


@keras.saving.register_keras_serializable(package="keras_sparse_tests")
class Subclassed(keras.Model):
    def __init__(self, optimizer="adagrad", **kwargs):
        super().__init__(**kwargs)
        self.embedding = ks.AllToAllDenseEmbedding(
            ROWS, DIM, combiner="mean", optimizer=optimizer
        )
        self.head = _dense()

    def call(self, ids, training=None):
        # Keras trainers pass `training` only to models whose call takes it.
        return self.head(self.embedding(ids, training=training))


def _build(style, optimizer="adagrad"):
    if style == "functional":
        ids = keras.Input((BAG,), dtype="int32")
        emb = ks.AllToAllDenseEmbedding(ROWS, DIM, combiner="mean", optimizer=optimizer)
        model = keras.Model(ids, _dense()(emb(ids)))
    elif style == "sequential":
        emb = ks.AllToAllDenseEmbedding(ROWS, DIM, combiner="sum", optimizer=optimizer)
        model = keras.Sequential([keras.Input((BAG,), dtype="int32"), emb, _dense()])
    else:
        model = Subclassed(optimizer)
        model(np.zeros((1, BAG), "int32"))
        emb = model.embedding
    emb.embeddings.assign(_init())
    return model, emb


JIT_CASES = [False, True] if BACKEND != "torch" else [False]


@pytest.mark.parametrize("jit", JIT_CASES)
@pytest.mark.parametrize("style", ["functional", "sequential", "subclassed"])
def test_fit_evaluate_predict(style, jit):
    model, emb = _build(style)
    model.compile(keras.optimizers.Adam(0.05), "mse", jit_compile=jit)
    x, y = _data()
    before = emb.embeddings.numpy().copy()
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert not np.allclose(emb.embeddings.numpy(), before)
    loss = model.evaluate(x, y, verbose=0)
    pred = model.predict(x, verbose=0)
    assert pred.shape == (64, 1) and np.isfinite(loss)
    np.testing.assert_allclose(np.mean((pred - y) ** 2), loss, rtol=1e-4)


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile path")
def test_torch_jit_compile_fit():
    model, emb = _build("functional", optimizer="sgd")
    model.compile("sgd", "mse", jit_compile=True)
    x, y = _data(32)
    before = emb.embeddings.numpy().copy()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert not np.allclose(emb.embeddings.numpy(), before)


@pytest.mark.parametrize("optimizer", ["adam", "ftrl", None])
def test_save_load_continues_identically(tmp_path, optimizer):
    x, y = _data(96, seed=1)
    model, emb = _build("functional", optimizer)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(x[:48], y[:48], batch_size=16, shuffle=False, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    emb2 = restored.layers[1]
    assert isinstance(emb2, ks.AllToAllDenseEmbedding)
    np.testing.assert_array_equal(emb2.embeddings.numpy(), emb.embeddings.numpy())
    for name, slot in emb.slots.items():
        np.testing.assert_array_equal(emb2.slots[name].numpy(), slot.numpy())
    # The original keeps training: that is the uninterrupted run.
    h1 = model.fit(x[48:], y[48:], batch_size=16, shuffle=False, verbose=0)
    h2 = restored.fit(x[48:], y[48:], batch_size=16, shuffle=False, verbose=0)
    np.testing.assert_allclose(h2.history["loss"], h1.history["loss"], rtol=1e-6)
    np.testing.assert_allclose(
        emb2.embeddings.numpy(), emb.embeddings.numpy(), atol=1e-7
    )
    if optimizer is not None:
        assert int(emb2.sparse_iterations.numpy()) == int(emb.sparse_iterations.numpy())


def test_config_round_trip():
    layer = ks.AllToAllDenseEmbedding(
        50,
        6,
        combiner="sqrtn",
        optimizer=ks.optimizers.RowWiseAdagrad(0.3),
        mask_zero=True,
        sharding="row",
        embeddings_regularizer="l2",
        name="t",
    )
    again = ks.AllToAllDenseEmbedding.from_config(layer.get_config())
    assert again.get_config() == layer.get_config()
    assert isinstance(again.sparse_optimizer, ks.optimizers.RowWiseAdagrad)
    assert again.sparse_optimizer.learning_rate == pytest.approx(0.3)


@keras.saving.register_keras_serializable(package="keras_sparse_tests")
class NoTrainingArg(keras.Model):
    """A subclassed model whose call drops `training`: layers see None."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = ks.AllToAllDenseEmbedding(
            ROWS, DIM, combiner="sum", optimizer="adam"
        )
        self.head = _dense()

    def call(self, ids):
        return self.head(self.embedding(ids))


def test_call_without_training_flag_neither_updates_nor_corrupts():
    """With training=None inside a gradient step the table stays as it was
    (on JAX the optimizer would otherwise overwrite it with a gradient)."""
    model = NoTrainingArg()
    model(np.zeros((1, BAG), "int32"))
    model.compile("sgd", "mse")
    before = model.embedding.embeddings.numpy().copy()
    x, y = _data(32)
    model.fit(x, y, verbose=0)
    np.testing.assert_array_equal(model.embedding.embeddings.numpy(), before)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_output_outside_the_loss_leaves_the_table_alone(optimizer):
    """A sparse layer feeding only an output without a loss: its table must
    not change (on JAX it would be overwritten with an all-zero gradient if
    the lookup's backward pass were skipped)."""
    ids = keras.Input((BAG,), dtype="int32")
    other = keras.Input((3,))
    emb = ks.AllToAllDenseEmbedding(
        ROWS, DIM, combiner="sum", optimizer=optimizer, name="unused_emb"
    )
    outputs = {
        "scored": keras.layers.Dense(1, name="scored")(other),
        "unscored": keras.layers.Dense(1, name="unscored")(emb(ids)),
    }
    model = keras.Model([ids, other], outputs)
    model.compile("sgd", loss={"scored": "mse"})
    before = keras.ops.convert_to_numpy(emb.embeddings).copy()
    x, y = _data(32)
    feats = np.ones((32, 3), "float32")
    model.fit([x, feats], {"scored": y, "unscored": y}, batch_size=8, verbose=0)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(emb.embeddings), before)


def test_frozen_layer_is_not_updated():
    model, emb = _build("functional", optimizer="adam")
    emb.trainable = False
    model.compile("sgd", "mse")
    before = emb.embeddings.numpy().copy()
    x, y = _data(32)
    model.fit(x, y, verbose=0)
    np.testing.assert_array_equal(emb.embeddings.numpy(), before)


def test_regularizer_adds_loss_with_sparse_optimizer():
    layer = ks.AllToAllDenseEmbedding(
        10, 2, optimizer="sgd", embeddings_regularizer="l2"
    )
    layer.build()
    layer(np.array([[1, 2]]), training=True)
    assert len(layer.losses) == 1


def test_checkpoint_missing_a_variable_is_refused(tmp_path):
    """A weights file without the slots / step counter the layer needs is
    refused, naming what is missing, and nothing is loaded."""

    def model(optimizer):
        ids = keras.Input((2,), dtype="int32")
        emb = ks.AllToAllDenseEmbedding(20, 4, optimizer=optimizer, name="emb")
        return keras.Model(ids, keras.layers.Dense(1)(emb(ids)))

    plain = model(None)
    path = str(tmp_path / "plain.weights.h5")
    plain.save_weights(path)
    sparse = model("adagrad")
    sparse.build((None, 2))
    emb = sparse.get_layer("emb")
    before = [np.array(w) for w in emb.get_weights()]
    with pytest.raises(
        ValueError, match=r"emb.*no \['slot_accumulator', 'sparse_iterations'\]"
    ):
        sparse.load_weights(path)
    for old, new in zip(before, emb.get_weights(), strict=True):
        np.testing.assert_array_equal(old, new)


class AllToAllDenseEmbedding(ks.AllToAllDenseEmbedding):
    """Saves as keras_sparse 0.1 did: Keras placed the layer's weights under
    its class name ("all_to_all_dense_embedding") and the table was stored
    under the key "embeddings"."""

    def save_own_variables(self, store):
        store["embeddings"] = self.embeddings.numpy()


@pytest.mark.parametrize("file_name", ["old.weights.h5", "old.keras"])
def test_files_of_version_0_1_still_load(tmp_path, file_name):
    def model(cls):
        ids = keras.Input((2,), dtype="int32")
        first = cls(20, 4, name="first")(ids)
        second = cls(7, 4, name="second")(ids)
        return keras.Model(ids, keras.layers.Add()([first, second]))

    old = model(AllToAllDenseEmbedding)
    path = str(tmp_path / file_name)
    if file_name.endswith(".keras"):
        old.save(path)
    else:
        old.save_weights(path)
    new = model(ks.AllToAllDenseEmbedding)
    new.load_weights(path)
    for name in ("first", "second"):
        np.testing.assert_array_equal(
            new.get_layer(name).embeddings.numpy(),
            old.get_layer(name).embeddings.numpy(),
        )
