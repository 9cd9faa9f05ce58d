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
