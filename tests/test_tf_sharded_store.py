"""Key-sharded hash layers over row stores under tf.distribute.MirroredStrategy
(TensorFlow, 2 replicas): each replica's table shard is a cache of a few
rows over its own store, and training equals training with one device
holding every key (no store), key by key.

The reference is the same model on one device with a capacity no key is
evicted from; the sharded layers hold 64 rows (32 per shard) for ~300
keys, so every shard keeps evicting keys down to its store and filling
them back. Every key's record (vector, optimizer slots, LRU/LFU score)
must match, and so must predictions (which read evicted keys from the
stores) and the records of the saved file, reloaded under the strategy
and on one device. The cases run in a fresh subprocess (the logical CPU
devices must exist before TensorFlow starts) and print their results.
"""

import json
import os
import tempfile

import keras
import numpy as np
import pytest

from tests.helpers import max_gap
from tests.subprocess_results import module_results

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="tf.distribute runs on the TensorFlow backend only",
)

DIM, FIELDS, BATCH, STEPS, TOL = 4, 2, 32, 10, 1e-5
# name: (optimizer, eviction); one row-wise optimizer, LRU and LFU.
LAYERS = {
    "sgd": ("sgd", "lru"),
    "adagrad": ("adagrad", "lfu"),
    "rowwise": ("rowwise_adagrad", "lru"),
}


# ---------------------------------------------------------------- subprocess
def _data():
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, 301) ** 0.9  # Zipf-like: a long tail evicts
    ranks = rng.choice(300, size=(BATCH * STEPS, FIELDS), p=p / p.sum())
    keys = ranks.astype(np.int64) * 7_919 + (5 << 33)
    return keys, rng.normal(size=(len(keys), 1)).astype("float32")


def _model(capacity, stores):
    """Every layer on the same keys; ``stores``: layer name -> its store
    (None: no store)."""
    import keras_sparse as ks

    keras.utils.set_random_seed(0)
    keys = keras.Input((FIELDS,), dtype="int64")
    features = [
        ks.DistributedHashEmbedding(
            DIM, capacity=capacity, combiner="sum", optimizer=optimizer,
            eviction=eviction, store=stores.get(name), name=name,
            embeddings_initializer="random_normal",
        )(keys)
        for name, (optimizer, eviction) in LAYERS.items()
    ]  # fmt: skip
    out = keras.layers.Dense(1, name="head")(keras.layers.Concatenate()(features))
    model = keras.Model(keys, out)
    model.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=False)
    return model


def _records(model):
    """Each layer's records (table and store) by key, and the head."""
    out = {}
    for name in LAYERS:
        rec = model.get_layer(name).export()
        order = np.argsort(rec["keys"], kind="stable")
        out.update({f"{name}/{k}": np.asarray(v)[order] for k, v in rec.items()})
    for i, w in enumerate(model.get_layer("head").get_weights()):
        out[f"head/{i}"] = w
    return out


def _predict(model):
    return model.predict(_data()[0][: 2 * BATCH], batch_size=BATCH, verbose=0)


def _run(tmp):
    import tensorflow as tf

    import keras_sparse as ks

    x, y = _data()
    with tf.device("/cpu:0"):
        reference = _model(4096, {})
        reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        want, want_predict = _records(reference), _predict(reference)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    stores = {"sgd": "host", "adagrad": "host"}
    stores["rowwise"] = ks.store.Disk(os.path.join(tmp, "rowwise"))
    out = {}
    with strategy.scope():
        model = _model(64, stores)
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        layer = model.get_layer("sgd")
        out["placement"] = repr(layer.placement)
        out["shard_stores"] = len(layer.row_tier.shards)
        out["stats"] = {n: model.get_layer(n).stats() for n in LAYERS}
        got = _records(model)
        out["keys"] = {n: int(len(want[f"{n}/keys"])) for n in LAYERS}
        out["fit"] = max_gap(got, want)
        out["predict"] = float(np.abs(_predict(model) - want_predict).max())
        path = os.path.join(tmp, "sharded.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        out["reloaded"] = max_gap(_records(loaded), got)
    with tf.device("/cpu:0"):
        one = keras.models.load_model(path)
        out["one_device"] = max_gap(_records(one), got)
        out["one_device_predict"] = float(np.abs(_predict(one) - want_predict).max())
    return out


def _main():
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    print("RESULTS " + json.dumps(_run(tempfile.mkdtemp())))


if __name__ == "__main__":
    _main()


# --------------------------------------------------------------------- tests
def _results():
    return module_results(__file__, timeout=400)


def test_each_replica_caches_its_shard_over_its_own_store():
    results = _results()
    assert results["placement"] == "TfKeyPlacement(devices=2)"
    assert results["shard_stores"] == 2
    for name, stats in results["stats"].items():
        # Every layer evicts keys down and fills them back, and every key
        # of every step got a row.
        assert stats["evictions"] >= 50 and stats["fills"] >= 10, (name, stats)
        assert stats["write_backs"] == stats["evictions"], (name, stats)
        assert stats["overflows"] == 0, (name, stats)
        assert stats["size"] + stats["store_size"] == results["keys"][name]


def test_training_equals_one_device_holding_every_key():
    """Keys, values, slots and scores of every layer (table and store),
    and the head, for SGD, Adagrad (LFU) and RowWiseAdagrad (disk store)."""
    results = _results()
    assert results["fit"] <= TOL
    assert results["predict"] <= TOL


def test_saved_file_holds_every_row_under_the_strategy_and_on_one_device():
    results = _results()
    assert results["reloaded"] == 0.0
    assert results["one_device"] == 0.0
    assert results["one_device_predict"] <= TOL
