"""Small model builders shared by the layer tests."""

import keras
import numpy as np


def pooled_model(layer, bag, dtype="int32"):
    """ids [batch, bag] -> layer -> sum over features -> [batch, 1]."""
    ids = keras.Input((bag,), dtype=dtype)
    x = layer(ids)
    while len(x.shape) > 2:
        x = keras.layers.Flatten()(x)
    out = keras.layers.Lambda(lambda t: keras.ops.sum(t, axis=-1, keepdims=True))(x)
    return keras.Model(ids, out)


def random_batches(num_rows, batch, bag, steps, seed=0, cover_all=False):
    rng = np.random.default_rng(seed)
    xs = []
    for _ in range(steps):
        x = rng.integers(0, num_rows, size=(batch, bag))
        if cover_all:
            flat = x.reshape(-1)
            flat[:num_rows] = rng.permutation(num_rows)
            x = flat.reshape(batch, bag)
        xs.append(x)
    x = np.concatenate(xs).astype("int32")
    y = rng.normal(size=(x.shape[0], 1)).astype("float32")
    return x, y


class _StepLosses(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def fit_losses(model, x, y, batch_size):
    """One unshuffled epoch of ``model.fit``; the loss of every step."""
    rec = _StepLosses()
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0, callbacks=[rec])
    return rec.losses


def docs_code(page, heading):
    """The first ```python block after ``heading`` in ``page`` (from the root)."""
    from tests import docs_blocks

    lines = (docs_blocks.ROOT / page).read_text().split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith(heading)) + 1
    blocks = docs_blocks.blocks(page)
    return next(b.code for b in blocks if b.language == "python" and b.line > at)
