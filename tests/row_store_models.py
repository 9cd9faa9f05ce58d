"""Shared by the row-store tests: Zipf batches, a one-hash-layer model and
its records sorted by key, a model file's weights."""

import io
import zipfile

import h5py
import keras
import numpy as np

from keras_sparse.layers.hash.embedding import DistributedHashEmbedding

BATCH, FIELDS = 8, 2


def batches(seed, universe, steps):
    rng = np.random.default_rng(seed)
    # Zipf-like: a few hot keys, a long tail that keeps evicting.
    p = 1.0 / np.arange(1, universe + 1) ** 0.9
    ranks = rng.choice(universe, size=(steps * BATCH, FIELDS), p=p / p.sum())
    keys = (ranks * 7919 + 3).astype("int64")
    keys[::5, 1] = -(2**62) - ranks[::5, 1]  # far keys too (the words' high half)
    target = rng.normal(size=(steps * BATCH, 1)).astype("float32")
    return keys, target


def model(capacity, store, eviction="lru", optimizer="adagrad", admit_after=1):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((FIELDS,), dtype="int64")
    layer = DistributedHashEmbedding(
        4,
        capacity=capacity,
        combiner="sum",
        optimizer=optimizer,
        eviction=eviction,
        admit_after=admit_after,
        store=store,
        name="ids",
    )
    out = keras.Model(inputs, keras.layers.Dense(1)(layer(inputs)))
    out.compile(optimizer="sgd", loss="mse")
    return out, layer


def records(layer):
    rec = layer.export()
    order = np.argsort(rec["keys"])
    return {name: np.asarray(value)[order] for name, value in rec.items()}


def weights_entries(path):
    """``{entry path: array}`` of a .keras file's weights."""
    with zipfile.ZipFile(path) as zf:
        data = io.BytesIO(zf.read("model.weights.h5"))
    out = {}
    with h5py.File(data, "r") as f:
        f.visititems(
            lambda name, obj: (
                out.__setitem__(name, obj[...])
                if isinstance(obj, h5py.Dataset)
                else None
            )
        )
    return out
