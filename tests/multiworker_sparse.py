"""EmbeddingCollection and key-sharded hash tables across the workers of a
MultiWorkerMirroredStrategy: the cases `tests/test_tf_multiworker.py`'s
worker processes run after the dense tables (same launch), printed as
``SPARSE {json}``.

One model holds a collection ("table", "row", "column" and "data" tables)
and two key-sharded hash layers under pressure (LRU and LFU, admit_after=2,
128 rows for ~200 keys). The reference is the same model on one device
whose hash layers hold a `ShardedHashTable` of 2 shards (the per-shard
capacity, admission and eviction the 2 workers have), as in
`tests/test_tf_sharded_hash.py`.

A third key-sharded hash layer ("stored") caches 128 rows over a host
store per worker (``store="host"``): each worker's shard evicts keys down
to its own store and fills them back. Its reference is the same layer on
one device with a capacity no key is evicted from (and no store): every
key's values, slots and score must match (`tests/test_tf_sharded_store.py`
does the same under a MirroredStrategy of one process).
"""

import os

import keras
import numpy as np

from tests.helpers import max_gap
from tests.helpers import replica_shapes

DIM, GLOBAL, STEPS, KEYS, CAPACITY, SHARDS = 4, 32, 6, 200, 128, 2
# Collection tables: name: (rows, combiner, sharding, ids per sample).
TABLES = {
    "ta": (13, "sum", "table", 3),
    "tb": (7, None, "table", None),
    "row": (11, "mean", "row", 2),
    "col": (9, None, "column", None),
    "data": (5, None, "data", None),
}
HASH = {
    "lru": dict(eviction="lru", optimizer="adagrad"),
    "lfu": dict(eviction="lfu", optimizer="adam"),
}
HASH_STATE = ("record_", "admission_", "table_clock")
# The layer over stores: LRU, Adagrad, and 128 rows for ~200 keys; its
# rows and clock are the cache's own, not compared with the reference's.
STORED, STORED_ARGS, BIG = "stored", dict(eviction="lru", optimizer="adagrad"), 4096


def model(reference=False):
    """The collection and hash layers, seeded alike everywhere; with
    ``reference`` the hash layers hold a 2-shard `ShardedHashTable`."""
    import keras_sparse as ks
    from keras_sparse.table import ShardedHashTable

    keras.utils.set_random_seed(0)

    def seeded(i):
        return keras.initializers.RandomUniform(-0.5, 0.5, seed=i)

    tables, inputs = {}, {}
    for i, (name, (rows, combiner, sharding, width)) in enumerate(TABLES.items()):
        tables[name] = ks.TableConfig(
            rows, DIM, combiner=combiner, sharding=sharding,
            embeddings_initializer=seeded(i),
        )  # fmt: skip
        shape = () if width is None else (width,)
        inputs[name] = keras.Input(shape, dtype="int32", name=name)
    optimizer = ks.optimizers.Adagrad(0.1)
    out = ks.EmbeddingCollection(tables, optimizer=optimizer, name="coll")(inputs)
    features = [out[n] for n in TABLES]
    inputs["keys"] = keras.Input((3,), dtype="int64", name="keys")
    for name, args in HASH.items():
        layer = ks.DistributedHashEmbedding(
            DIM, capacity=CAPACITY, admit_after=2, combiner="sum", sharding="key",
            name=name, **args,
        )  # fmt: skip
        features.append(layer(inputs["keys"]))
        if reference:  # built: the table stays
            layer.table = ShardedHashTable(
                CAPACITY, SHARDS, eviction=args["eviction"], admit_after=2, seed=0
            )
    stored = ks.DistributedHashEmbedding(
        DIM, capacity=BIG if reference else CAPACITY, combiner="sum",
        sharding="key", store=None if reference else "host", name=STORED,
        embeddings_initializer=seeded(50), **STORED_ARGS,
    )  # fmt: skip
    features.append(stored(inputs["keys"]))
    head = keras.layers.Dense(1, kernel_initializer=seeded(99), name="head")
    return keras.Model(inputs, head(keras.layers.Concatenate()(features)))


def data(samples=GLOBAL * STEPS, seed=0):
    rng = np.random.default_rng(seed)
    x = {}
    for name, (rows, _, _, width) in TABLES.items():
        shape = (samples,) if width is None else (samples, width)
        x[name] = rng.integers(0, rows, shape).astype("int32")
    x["ta"][:, 0] = 12  # a row both workers read in every step
    keys = rng.integers(0, KEYS, (samples, 3)).astype(np.int64) * 7_919 + (5 << 33)
    keys[::4, 0] = keys[0, 0]  # a key both workers see
    x["keys"] = keys
    return x, rng.normal(size=(samples, 1)).astype("float32")


def state(model):
    """The collection's saved tables and slots, each hash layer's saved
    records sorted by key (rows, values, slots, scores), pending admission
    counts and clock, and the head (under the strategy a collective)."""
    out = {}
    store = {}
    model.get_layer("coll").save_own_variables(store)
    out.update({f"coll/{k}": np.asarray(v) for k, v in store.items()})
    for name in HASH:
        store = {}
        model.get_layer(name).save_own_variables(store)
        order = np.argsort(store["record_keys"], kind="stable")
        for k, v in store.items():
            if k.startswith(HASH_STATE):
                v = np.asarray(v)
                out[f"{name}/{k}"] = v[order] if k.startswith("record_") else v
    out.update(_stored_records(model.get_layer(STORED)))
    for i, w in enumerate(model.get_layer("head").get_weights()):
        out[f"head/{i}"] = w
    return out


def _stored_records(layer):
    """The stored layer's saved records (table and stores) sorted by key
    (under the strategy a collective)."""
    store = {}
    layer.save_own_variables(store)
    order = np.argsort(store["record_keys"], kind="stable")
    return {
        f"{STORED}/{k}": np.asarray(v)[order]
        for k, v in store.items()
        if k.startswith("record_") and k != "record_rows"
    }


def _exported(layer, index=None):
    """``layer.export()`` sorted by key; with ``index``, the keys shard
    ``index`` of 2 owns only."""
    from keras_sparse.table.sharded_table import owner_of

    rec = layer.export()
    keep = np.ones(len(rec["keys"]), bool)
    if index is not None:
        keep = owner_of(np.asarray(rec["keys"], np.int64), SHARDS) == index
    order = np.argsort(rec["keys"][keep], kind="stable")
    return {k: np.asarray(v)[keep][order] for k, v in rec.items()}


def _stats(model):
    counters = ("hits", "misses", "inserts", "evictions", "rejected_admissions")
    return {
        n: {k: int(v) for k, v in model.get_layer(n).stats().items() if k in counters}
        for n in HASH
    }


def _predict(model, x):
    try:
        return model.predict(x, batch_size=GLOBAL, verbose=0), None
    except Exception as error:  # noqa: BLE001 - the test reads what came
        return None, f"{type(error).__name__}: {error}"[:1500]


def run(strategy, train, index, tmp, mark):
    """The cases; ``train(model, x, y)`` trains in the strategy's loop."""
    import tensorflow as tf

    chief = index == 0
    x, y = data()
    reference = model(reference=True)
    reference.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=False)
    reference.fit(x, y, batch_size=GLOBAL, shuffle=False, verbose=0)
    want = state(reference)
    out = {"reference_stats": _stats(reference)}
    mark("sparse reference")
    with strategy.scope():
        sharded = model()
    coll = sharded.get_layer("coll")
    out["placements"] = {s.name: repr(s.placement) for s in coll.stacks}
    out["hash_placement"] = repr(sharded.get_layer("lru").placement)
    out["local_shards"] = list(sharded.get_layer("lru").table.local)
    out["shapes"] = replica_shapes(strategy, coll)
    train(sharded, x, y)
    mark("sparse trained")
    trained = state(sharded)
    out["trained"] = max_gap(trained, want)
    out["stats"] = _stats(sharded)  # this worker's shards
    # The stored layer: this worker's shard and store, key by key.
    layer = sharded.get_layer(STORED)
    out["stored_stats"] = {k: int(v) for k, v in layer.stats().items()}
    out["stored_keys"] = int(len(reference.get_layer(STORED).export()["keys"]))
    out["stored_export"] = max_gap(
        _exported(layer), _exported(reference.get_layer(STORED), index)
    )

    # Inference: training data (evicted and rejected keys included) and
    # unseen keys; nothing is counted or inserted.
    probe, _ = data(2 * GLOBAL, seed=1)
    probe["keys"][: GLOBAL // 2] = x["keys"][: GLOBAL // 2]
    expected = np.asarray(reference(probe, training=False))
    outside = np.asarray(sharded(probe, training=False))
    out["call_outside_step"] = float(np.abs(outside - expected).max())
    predicted, out["predict_error"] = _predict(sharded, probe)
    if predicted is not None:
        out["predict"] = float(np.abs(predicted - expected).max())
    # Its records are compared after the save below (`reloaded`).
    out["inference_keeps_stats"] = _stats(sharded) == out["stats"]
    out["stored_inference_keeps_stats"] = {
        k: int(v) for k, v in layer.stats().items() if k != "store_hits"
    } == {k: v for k, v in out["stored_stats"].items() if k != "store_hits"}
    # Evicted keys of the probe were read from their owners' stores.
    out["stored_reads"] = int(layer.stats()["store_hits"])
    mark("sparse inferred")

    path = os.path.join(tmp, "sparse.keras" if chief else f"sparse{index}.keras")
    sharded.save(path)
    with strategy.scope():
        loaded = keras.models.load_model(path)
    # The file was saved after the inference above: equal to the trained
    # state, it shows inference changed no record, count or clock.
    out["reloaded"] = max_gap(state(loaded), trained)
    out["reloaded_placements"] = [
        repr(loaded.get_layer("coll").stacks[0].placement),
        repr(loaded.get_layer("lfu").placement),
    ]
    reloaded = np.asarray(loaded(probe, training=False))
    out["reloaded_call"] = float(np.abs(reloaded - expected).max())
    if chief:
        with tf.device("/cpu:0"):
            out["one_device"] = _one_device(path, reference, probe, expected)
    mark("sparse saved")
    return out


def _one_device(path, reference, probe, expected):
    """The chief's file on one device (no strategy): the collection equals
    the reference; each hash table re-places its keys in one table of the
    same capacity (a few whose buckets filled up are dropped): the kept
    keys' records equal the reference's."""
    one = keras.models.load_model(path)
    out = {"placement": repr(one.get_layer("lru").placement)}
    coll = {k: v for k, v in state(one).items() if k.startswith(("coll/", "head/"))}
    want = {k: v for k, v in state(reference).items() if k in coll}
    out["collection"] = max_gap(coll, want)
    dropped, gaps, lost = {}, [0.0], []
    for name in HASH:
        got = one.get_layer(name).export()
        ref = reference.get_layer(name).export()
        kept = np.isin(ref["keys"], got["keys"])
        dropped[name] = int((~kept).sum())
        lost.extend(ref["keys"][~kept].tolist())
        a, b = np.argsort(got["keys"]), np.argsort(ref["keys"][kept])
        gaps.append(max_gap({k: v[a] for k, v in got.items()},
                            {k: v[kept][b] for k, v in ref.items()}))  # fmt: skip
    out["dropped"], out["hash"] = dropped, max(gaps)
    # The stored layer keeps every key (in its table or its store).
    out["stored"] = max_gap(
        _exported(one.get_layer(STORED)), _exported(reference.get_layer(STORED))
    )
    keep = ~np.isin(probe["keys"], lost).any(axis=1)
    predicted = np.asarray(one(probe, training=False))
    out["call"] = float(np.abs(predicted - expected)[keep].max())
    out["compared_samples"] = int(keep.sum())
    return out
