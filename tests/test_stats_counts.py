"""`DistributedHashEmbedding.stats()` counts the same on every backend.

The counters are checked against a plain-Python model of the table (a set
of keys with rows and a sighting count per key), fed the same keys one at a
time: each training step's keys count once, shuffled or not; shape
inference, tracing, evaluate and predict count nothing.
"""

from collections import Counter

import keras
import numpy as np
import pytest

from keras_sparse.data import prefetch
from keras_sparse.layers import DistributedHashEmbedding
from keras_sparse.table import HashTable

N, BATCH, BAG, VOCAB = 1200, 100, 2, 300
COUNTERS = ("hits", "misses", "inserts", "rejected_admissions")


def _data(seed=0):
    """Wide int64 keys (beyond int32), duplicates within and across
    samples, and about one position in ten padding (weight 0)."""
    rng = np.random.default_rng(seed)
    vocab = rng.choice(2**40, size=VOCAB, replace=False).astype("int64") + 2**33
    keys = vocab[rng.zipf(1.5, size=(N, BAG)) % VOCAB]
    weights = (rng.random((N, BAG)) > 0.1).astype("float32")
    y = rng.normal(size=(N, 1)).astype("float32")
    return keys, weights, y


def _reference(keys, weights, admit_after):
    """The counters of a table that sees the used keys one at a time and
    never evicts: a key gets a row at its ``admit_after``-th sighting."""
    state = {"rows": set(), "seen": Counter(), **dict.fromkeys(COUNTERS, 0)}
    for key in keys[weights != 0].tolist():
        if key in state["rows"]:
            state["hits"] += 1
            continue
        state["misses"] += 1
        state["seen"][key] += 1
        if state["seen"][key] >= admit_after:
            state["rows"].add(key)
            state["inserts"] += 1
        else:
            state["rejected_admissions"] += 1
    return {name: state[name] for name in COUNTERS}


def _counters(layer):
    stats = layer.stats()
    assert stats["evictions"] == 0 and stats["overflows"] == 0
    return {name: stats[name] for name in COUNTERS}


def _model(admit_after=(1, 3)):
    """One hash layer per ``admit_after`` on the same keys. A large table
    (and so a wide admission sketch): no evictions, and no sketch collision
    admits a key early, as in the reference."""
    keys = keras.Input((BAG,), dtype="int64", name="keys")
    weights = keras.Input((BAG,), dtype="float32", name="weights")
    layers = [
        DistributedHashEmbedding(
            4, capacity=4096, combiner="sum", optimizer="sgd", admit_after=a
        )
        for a in admit_after
    ]
    pooled = [layer(keys, weights=weights) for layer in layers]
    out = keras.layers.Dense(1)(keras.layers.Concatenate()(pooled))
    model = keras.Model([keys, weights], out)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model, dict(zip(admit_after, layers))


def _check(layers, batches):
    for admit_after, layer in layers.items():
        want = _reference(*batches, admit_after)
        assert _counters(layer) == want, admit_after


def test_fit_counts_each_step_once_and_inference_nothing():
    keys, weights, y = _data()
    model, layers = _model()
    for layer in layers.values():
        assert _counters(layer) == dict.fromkeys(COUNTERS, 0)
    # Shuffled: the batches differ by backend, the counts must not.
    model.fit([keys, weights], y, batch_size=BATCH, shuffle=True, verbose=0)
    _check(layers, (keys, weights))

    model.evaluate([keys, weights], y, batch_size=BATCH, verbose=0)
    model.predict([keys, weights], batch_size=BATCH, verbose=0)
    for layer in layers.values():
        layer(keys[:BATCH], weights=weights[:BATCH])  # eager inference
    _check(layers, (keys, weights))

    # Training goes on from the counts so far.
    more_keys, more_weights, more_y = (a[: 2 * BATCH] for a in _data(seed=1))
    model.fit([more_keys, more_weights], more_y, batch_size=BATCH, verbose=0)
    both = (
        np.concatenate([keys, more_keys]),
        np.concatenate([weights, more_weights]),
    )
    _check(layers, both)


def test_prefetch_stage_counts_each_batch_once():
    keys, weights, y = _data()
    model, layers = _model(admit_after=(2,))
    with prefetch(([keys, weights], y), model, batch_size=BATCH, threads=2) as stage:
        model.fit(stage, epochs=1, verbose=0)
    _check(layers, (keys, weights))


@pytest.mark.parametrize("admit_after", [1, 2, 3])
def test_table_counts_do_not_depend_on_batching(admit_after):
    """The table counts sightings one at a time, so any split of the same
    key stream into calls gives the reference's counts."""
    rng = np.random.default_rng(admit_after)
    stream = rng.zipf(1.3, size=2000) % 200
    ones = np.ones_like(stream)
    want = _reference(stream, ones, admit_after)
    for cuts in ([], [1000], sorted(rng.choice(2000, size=30, replace=False))):
        table = HashTable(4096, admit_after=admit_after, device="cpu")
        for part in np.split(stream, cuts):
            table.lookup_or_insert(part)
        stats = table.stats()
        assert {name: stats[name] for name in COUNTERS} == want, cuts
        table.lookup(stream, count=False)  # a read that is not counted
        assert table.stats() == stats


class _Wrapper(keras.layers.Layer):
    """Calls a layer with a fixed ``training``; no `compute_output_shape`,
    so Keras infers its output by calling it (`compute_output_spec`)."""

    def __init__(self, inner, training):
        super().__init__()
        self.inner, self.training = inner, training

    def build(self, input_shape):
        self.inner.build(input_shape)

    def call(self, keys):
        return self.inner(keys, training=self.training)


def test_shape_inference_never_reaches_the_table():
    """Keras infers shapes through `compute_output_spec` (a wrapping layer
    in a functional model, `fit` building a model); PyTorch runs it eagerly
    on placeholder values. Neither inserts nor counts, training or not."""
    layer = DistributedHashEmbedding(4, capacity=64, optimizer="sgd")
    keys = keras.Input((BAG,), batch_size=8, dtype="int64")
    for training in (True, False):
        assert tuple(_Wrapper(layer, training)(keys).shape) == (8, BAG, 4)
    assert layer.stats()["size"] == 0
    assert _counters(layer) == dict.fromkeys(COUNTERS, 0)
