"""Tables with ``cache_rows`` across the workers of a
MultiWorkerMirroredStrategy: the cases `tests/test_tf_multiworker.py`'s
worker processes run after the others (same launch), printed as
``CACHE {json}``.

A 3000-id table cached in 200 rows over a host store (each worker holds a
copy of the map, store and cache; every worker maps the whole gathered
batch) trains in the strategy's loop with SGD and with Adagrad. Its
unseeded initializer draws a different seed in each worker (the chief's
is shared). The reference is the same model and strategy without
``cache_rows``, from the same table and head: every id's values, slots
and step count must match exactly, and so must predictions; both
workers' copies must be identical (`digest`).
"""

import hashlib

import keras
import numpy as np

from tests import cached_tables
from tests.helpers import max_gap

ROWS, DIM, CACHE, GLOBAL, STEPS = 3000, 4, 200, 48, 5
OPTIMIZERS = ("sgd", "adagrad")


def data(steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, ROWS, (GLOBAL * steps, 2)).astype("int32")
    return x, rng.normal(size=(GLOBAL * steps, 1)).astype("float32")


def model(optimizer, cache):
    """``(model, layer)``: the table "ids" (``cache``: its ``cache_rows``
    and ``store``, or none) and a one-unit head "out"."""
    import keras_sparse as ks

    inputs = keras.Input((2,), dtype="int32")
    layer = ks.AllToAllDenseEmbedding(
        ROWS, DIM, combiner="sum", name="ids",
        optimizer=cached_tables.sparse_optimizer(optimizer), **cache,
    )  # fmt: skip
    head = keras.layers.Dense(1, name="out")
    return keras.Model(inputs, head(layer(inputs))), layer


def digest(cache, state):
    """A hash of a worker's whole copy: its table state, its cache
    variables and cached ids, its counters."""
    sha = hashlib.sha1()
    for key in sorted(state):
        sha.update(np.ascontiguousarray(state[key]).tobytes())
    for var in [cache.embeddings, *cache.slots.values()]:
        sha.update(np.ascontiguousarray(keras.ops.convert_to_numpy(var)).tobytes())
    sha.update(cache.slot_map.id_of_slot.tobytes())
    sha.update(repr(sorted(cache.stats().items())).encode())
    return sha.hexdigest()


def run(strategy, train, index, mark):
    """The cases; ``train(model, x, y)`` trains in the strategy's loop."""
    x, y = data()
    probe, _ = data(2, seed=1)
    probe[: GLOBAL // 2] = x[: GLOBAL // 2]  # trained ids, evicted or not
    out = {}
    for optimizer in OPTIMIZERS:
        keras.utils.set_random_seed(10 + index)  # unseeded: seeds differ
        with strategy.scope():
            cached, layer = model(optimizer, {"cache_rows": CACHE, "store": "host"})
            reference, plain = model(optimizer, {})
        start = cached_tables.start_from(cached, layer, "dense", None)
        cached_tables.start_from(reference, plain, "dense", start)
        train(cached, x, y)
        train(reference, x, y)
        mark(f"cache {optimizer} trained")
        got = cached_tables.state("dense", layer)
        want = cached_tables.state("dense", plain)
        predicted = cached.predict(probe, batch_size=GLOBAL, verbose=0)
        expected = reference.predict(probe, batch_size=GLOBAL, verbose=0)
        out[optimizer] = {
            "exact": max_gap(got, want),
            "keys": sorted(got),
            "steps": int(got["steps"]),
            "moved": float(np.abs(got["0"] - start[0]).max()),
            "predict": float(np.abs(predicted - expected).max()),
            "stats": {k: int(v) for k, v in layer.row_cache.stats().items()},
            "digest": digest(layer.row_cache, got),
        }
    return out
