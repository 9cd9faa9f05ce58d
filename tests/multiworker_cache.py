"""Tables with ``cache_rows`` across the workers of a
MultiWorkerMirroredStrategy: the cases `tests/test_tf_multiworker.py`'s
worker processes run after the others (same launch), printed as
``CACHE {json}``.

Two 3000-id tables and an `EmbeddingCollection`'s table over the same
ids, each cached in 200 rows over a host store (each worker holds a copy
of the map, store and cache; every worker maps the whole gathered batch),
train in the strategy's loop, with SGD, Adagrad and Adagrad. Their
unseeded initializers draw a different seed in each worker (the chief's
is shared). The reference is the same
model and strategy without ``cache_rows``, from the same tables and head:
every id's values, slots and step count must match exactly, and so must
predictions; both workers' copies must be identical (`digest`).
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


def model(cache):
    """``(model, layers)``: a table per optimizer over the same ids, an
    `EmbeddingCollection` "coll" of one table "a" over them too (Adagrad)
    (``cache``: their ``cache_rows``, ``store`` and other arguments, or
    none), and a one-unit head "out"."""
    import keras_sparse as ks

    inputs = keras.Input((2,), dtype="int32")
    layers = {
        name: ks.AllToAllDenseEmbedding(
            ROWS,
            DIM,
            combiner="sum",
            name=name,
            optimizer=cached_tables.sparse_optimizer(name),
            **cache,
        )  # fmt: skip
        for name in OPTIMIZERS
    }
    features = [layer(inputs) for layer in layers.values()]
    layers["coll"] = ks.EmbeddingCollection(
        {"a": ks.TableConfig(ROWS, DIM, combiner="sum", **cache)},
        optimizer=cached_tables.sparse_optimizer("adagrad"),
        name="coll",
    )
    features.append(layers["coll"]({"a": inputs})["a"])
    out = keras.layers.Dense(1, name="out")(keras.layers.Concatenate()(features))
    return keras.Model(inputs, out), layers


def _kind(name):
    return "collection" if name == "coll" else "dense"


def _cache(layer):
    """A layer's cache (`CacheRows`): the dense table's, the collection's
    table "a"'s."""
    caches = getattr(layer, "table_caches", None)
    return layer.row_cache if caches is None else caches["a"]


def digest(cache, state):
    """A hash of a worker's whole copy: its table state, its cache
    variables and cached ids, its counters."""
    sha = hashlib.sha1()
    for key in sorted(state):
        sha.update(np.ascontiguousarray(state[key]).tobytes())
    for var in [cache.embeddings, *cache.slots.values()]:
        sha.update(np.ascontiguousarray(keras.ops.convert_to_numpy(var)).tobytes())
    sha.update(cache.slot_map.id_of_slot.tobytes())
    sha.update(repr(_counters(cache)).encode())
    return sha.hexdigest()


def _counters(cache):
    """The cache's counters but ``store_hits`` (which counts the reads of
    inference too: each worker's own share of a ``predict``)."""
    return {k: int(v) for k, v in cache.stats().items() if k != "store_hits"}


def run(strategy, train, index, mark):
    """The cases; ``train(model, x, y)`` trains in the strategy's loop."""
    x, y = data()
    probe, _ = data(2, seed=1)
    probe[: GLOBAL // 2] = x[: GLOBAL // 2]  # trained ids, evicted or not
    keras.utils.set_random_seed(10 + index)  # unseeded: seeds differ
    with strategy.scope():
        cached, layers = model({"cache_rows": CACHE, "store": "host"})
        reference, plain = model({})
    # The reference starts from the cached tables (the chief's) and head.
    start = {}
    for name, layer in layers.items():
        kind = _kind(name)
        begin = cached_tables.start_from(cached, layer, kind, None)
        cached_tables.start_from(reference, plain[name], kind, begin)
        start[name] = begin[0]
    train(cached, x, y)
    train(reference, x, y)
    mark("cache trained")
    trained = {name: _counters(_cache(layer)) for name, layer in layers.items()}
    predicted = cached.predict(probe, batch_size=GLOBAL, verbose=0)
    expected = reference.predict(probe, batch_size=GLOBAL, verbose=0)
    out = {"predict": float(np.abs(predicted - expected).max())}
    inferred = {name: _counters(_cache(layer)) for name, layer in layers.items()}
    for name, layer in layers.items():
        got = cached_tables.state(_kind(name), layer)
        want = cached_tables.state(_kind(name), plain[name])
        table = got["0"] if _kind(name) == "dense" else got["a:embeddings"]
        out[name] = {
            "exact": max_gap(got, want),
            "keys": sorted(got),
            "steps": int(
                got["steps" if _kind(name) == "dense" else "sparse_iterations"]
            ),
            "moved": float(np.abs(table - start[name]).max()),
            "stats": trained[name],
            "inference_keeps_stats": inferred[name] == trained[name],
            "digest": digest(_cache(layer), got),
        }
    return out


def refused(strategy, train, index):
    """Copies that differ (a seed per worker): ``(error, cache
    unchanged)``, the first step's error in each worker. (Later cases
    still train: the step's collectives went through. A disk folder both
    workers write is refused by the same check,
    tests/test_cache_workers_check.py; here the two workers would race to
    create its files.)"""
    seeded = keras.initializers.RandomUniform(-0.1, 0.1, seed=index)
    with strategy.scope():
        cached, layers = model(
            dict(cache_rows=CACHE, store="host", embeddings_initializer=seeded)
        )
    x, y = data(1)
    before = [_cache(layer).stats() for layer in layers.values()]
    try:
        train(cached, x, y)
        error = "trained"
    except Exception as e:  # noqa: BLE001  (TF wraps the error)
        error = str(e)
        error = error[error.find("Layer '") :][:600]
    return error, [_cache(layer).stats() for layer in layers.values()] == before
