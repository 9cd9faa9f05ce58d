"""Key-sharded DistributedHashEmbedding under tf.distribute.MirroredStrategy
(TensorFlow): each replica owns its keys' table shard and rows, and fit,
predict and saving match one device key by key.

Reference (as tests/test_sharding_key.py on JAX): the same model on one
device, its pressured layers holding a `ShardedHashTable` of ``D`` shards
(the per-shard capacity, admission, LRU/LFU and eviction a ``D``-replica
run has), and a roomy layer compared with the plain one-device layer (one
`HashTable`). The cases run in a fresh subprocess (the logical CPU devices
must exist before TensorFlow starts) and print their results as JSON.
"""

import json
import os

import keras
import numpy as np
import pytest

from tests.helpers import max_gap
from tests.subprocess_results import module_results

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="tf.distribute runs on the TensorFlow backend only",
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIM, BATCH, SAMPLES, TOL = 4, 32, 384, 1e-5
# name: layer arguments. "lru"/"lfu" see ~330 admitted keys for 256 rows.
LAYERS = {
    "lru": dict(capacity=256, eviction="lru", admit_after=2, optimizer="adagrad"),
    "lfu": dict(capacity=256, eviction="lfu", admit_after=2, optimizer="adam"),
    "roomy": dict(capacity=4096, combiner="mean", optimizer="adam"),
}
PRESSURED = ("lru", "lfu")


# ---------------------------------------------------------------- subprocess
def _data():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 500, (SAMPLES, 3)).astype(np.int64) * 7_919 + (5 << 33)
    keys[::4, 0] = keys[0, 0]  # a key every replica sees
    return keys, rng.normal(size=(SAMPLES, 1)).astype("float32")


def _model(sharded_tables=0, sharding="auto"):
    """Every layer on the same keys; ``sharded_tables``: the pressured
    layers get a ShardedHashTable of that many shards (the reference)."""
    import keras_sparse as ks
    from keras_sparse.table import ShardedHashTable

    keras.utils.set_random_seed(0)
    keys = keras.Input((3,), dtype="int64", name="keys")
    features = []
    for name, args in LAYERS.items():
        args = {"combiner": "sum", **args}
        layer = ks.DistributedHashEmbedding(DIM, name=name, sharding=sharding, **args)
        features.append(layer(keys))
        if sharded_tables and name in PRESSURED:  # built: the table stays
            layer.table = ShardedHashTable(
                args["capacity"], sharded_tables, eviction=args["eviction"],
                admit_after=args["admit_after"], seed=0,
            )  # fmt: skip
    out = keras.layers.Dense(1, name="head")(keras.layers.Concatenate()(features))
    model = keras.Model(keys, out)
    model.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=False)
    return model


def _fit(model):
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return model


def _records(model, rows, stats=True, keys=None):
    """Each layer's records by key (rows only where ``rows``; only those of
    ``keys[name]`` when given), its stats (not saved) and pending admission
    counts, and the head's weights."""
    out = {}
    for name in LAYERS:
        layer = model.get_layer(name)
        rec = layer.export(include_rows=name in rows)
        order = np.argsort(rec["keys"], kind="stable")
        if keys is not None:
            order = order[np.isin(rec["keys"][order], keys[name])]
        out.update({f"{name}/{k}": np.asarray(v)[order] for k, v in rec.items()})
        counters = layer.stats() if stats else {}
        for k in ("hits", "misses", "inserts", "evictions", "rejected_admissions"):
            if k in counters:
                out[f"{name}/stats/{k}"] = np.asarray(counters[k])
        pending = layer.table._impl.admission
        if pending is not None:
            out[f"{name}/pending_keys"], out[f"{name}/pending"] = pending.state()
    for i, w in enumerate(model.get_layer("head").get_weights()):
        out[f"head/{i}"] = w
    return out


def _predictions(model):
    x, _ = _data()
    x = x[: 3 * BATCH]
    return x, model.predict(x, batch_size=BATCH, verbose=0)


def _predict_gap(a, b, skip=()):
    """Largest prediction gap, on samples holding none of the keys ``skip``
    (``b``: a model, or its `_predictions`)."""
    x, want = b if isinstance(b, tuple) else _predictions(b)
    keep = ~np.isin(x, np.asarray(skip, np.int64)).any(axis=1)
    return float(np.abs(_predictions(a)[1] - want)[keep].max())


def _error(fn):
    try:
        fn()
    except (ValueError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _run_cases(replicas, tmp):
    import tensorflow as tf

    import keras_sparse as ks

    with tf.device("/cpu:0"):
        reference = _fit(_model(sharded_tables=replicas))
    # Strategies over different device sets in one process must not share
    # collective group keys.
    tf.distribute.MirroredStrategy._collective_key_base = 1000 * replicas
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    out = {}
    with strategy.scope():
        model = _fit(_model())
        layer = model.get_layer("lru")
        out["placement"] = repr(layer.placement)
        out["shards"] = layer.table.num_shards
        out["parts"] = [
            list(c.shape)
            for c in strategy.experimental_local_results(layer.embeddings.value)
        ]
        got = _records(model, PRESSURED)
        out["evictions"] = {n: int(got[f"{n}/stats/evictions"]) for n in PRESSURED}
        out["rejected"] = int(got["lru/stats/rejected_admissions"])
        out["fit"] = max_gap(got, _records(reference, PRESSURED))
        predicted = _predictions(model)
        out["predict"] = _predict_gap(reference, predicted)
        out["predict_keeps_stats"] = max_gap(_records(model, PRESSURED), got)
        path = os.path.join(tmp, f"key{replicas}.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        out["reloaded_placement"] = repr(loaded.get_layer("lfu").placement)
        saved = _records(model, LAYERS, stats=False)
        out["reloaded"] = max_gap(_records(loaded, LAYERS, stats=False), saved)
        if replicas == 2:  # another trace of every replica's step
            out["reloaded_predict"] = _predict_gap(loaded, predicted)
        if replicas == 2:  # the refusals do not depend on the count
            x, y = _data()
            out["prefetch"] = _error(
                lambda: ks.data.prefetch(x, model, y=y, batch_size=BATCH)
            )
            out["data_sharding"] = _error(lambda: _fit(_model(sharding="data")))
            out["initializer"] = _error(
                lambda: ks.DistributedHashEmbedding(
                    DIM, capacity=64, embeddings_initializer="orthogonal",
                    name="bad",
                ).build()
            )  # fmt: skip
    with tf.device("/cpu:0"):
        one = keras.models.load_model(path)
        out["one_device_table"] = type(one.get_layer("lru").table).__name__
        # A full table re-placed in one table of its capacity drops the
        # keys whose two buckets filled up (with a warning): compare those
        # kept.
        kept = {n: one.get_layer(n).export()["keys"] for n in LAYERS}
        out["one_device_dropped"] = {
            n: model.get_layer(n).table.size - len(kept[n]) for n in LAYERS
        }
        out["one_device"] = max_gap(
            _records(one, (), False), _records(model, (), False, keys=kept)
        )
        lost = [
            k for n in LAYERS for k in model.get_layer(n).export()["keys"]
            if k not in set(kept[n])
        ]  # fmt: skip
        out["one_device_predict"] = _predict_gap(one, predicted, skip=lost)
    return out


def _main():
    import tempfile

    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 4
    )
    tmp = tempfile.mkdtemp()
    results = {r: _run_cases(r, tmp) for r in (2, 4)}
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    _main()


# --------------------------------------------------------------------- tests
def _results(replicas):
    """The subprocess's results for ``replicas`` (one run for the module)."""
    return module_results(__file__, timeout=400)[str(replicas)]


REPLICAS = pytest.mark.parametrize("replicas", [2, 4])


@REPLICAS
def test_each_replica_owns_a_shard_and_its_rows(replicas):
    results = _results(replicas)
    assert results["placement"] == f"TfKeyPlacement(devices={replicas})"
    assert results["shards"] == replicas
    assert results["parts"] == [[256 // replicas, DIM]] * replicas


@REPLICAS
def test_fit_under_pressure_matches_one_device_key_by_key(replicas):
    """Same keys, rows, scores, admission counts and stats; values, slots
    and the head to 1e-5: LRU and LFU shards evict, admit_after=2 rejects,
    and the roomy layer equals the plain one-device layer."""
    results = _results(replicas)
    assert min(results["evictions"].values()) > 0
    assert results["rejected"] > 0
    assert results["fit"] <= TOL


@REPLICAS
def test_predict_matches_and_counts_nothing(replicas):
    results = _results(replicas)
    assert results["predict"] <= TOL
    assert results["predict_keeps_stats"] == 0.0


@REPLICAS
def test_save_and_load_under_the_strategy(replicas):
    results = _results(replicas)
    assert results["reloaded_placement"] == f"TfKeyPlacement(devices={replicas})"
    assert results["reloaded"] == 0.0
    assert results.get("reloaded_predict", 0.0) == 0.0


@REPLICAS
def test_file_loads_on_one_device(replicas):
    """Keys, vectors, slots, scores and admission counts survive; rows
    are re-placed in the one table (the full tables lose a few keys whose
    buckets filled up: predictions are compared on samples without
    them)."""
    results = _results(replicas)
    assert results["one_device_table"] == "HashTable"
    assert results["one_device"] == 0.0
    dropped = results["one_device_dropped"]
    assert dropped["roomy"] == 0 and max(dropped.values()) <= 8
    assert results["one_device_predict"] <= TOL


def test_prefetch_refuses_key_sharded_layers():
    error = _results(2)["prefetch"]
    assert error.startswith("ValueError") and "'lru' is key-sharded" in error
    assert "without the stage" in error


def test_replicated_hash_layers_are_refused_naming_key_sharding():
    error = _results(2)["data_sharding"]
    assert error.startswith("NotImplementedError") and "'lru'" in error
    assert "sharding='key'" in error and "2 replicas" in error


def test_initializers_that_cannot_draw_per_key_are_refused():
    error = _results(2)["initializer"]
    assert error.startswith("ValueError") and "'bad'" in error
    assert "sharding='auto'" in error and "Orthogonal" in error
    assert "RandomUniform" in error
