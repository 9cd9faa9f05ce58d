"""Tables with ``cache_rows`` under tf.distribute.MirroredStrategy
(TensorFlow, 2 replicas, one process) train as the same tables wholly on
the devices.

Each replica holds a copy of a 40-row cache of a 300-id table; one host
map serves both (`keras_sparse.layers.row_storage.cache_replicas`). The
reference is the same model and strategy without ``cache_rows``, from the
same table and head; every id's values and optimizer slots must match
exactly, and so must predictions (ids the cache does not hold are read
from the store) and the two replicas' copies of the cache. The cases run
in a fresh subprocess (the logical CPU devices must exist before
TensorFlow starts) and print their results.
"""

import json

import keras
import numpy as np
import pytest

from tests import cached_tables
from tests.cached_tables import VOCAB
from tests.subprocess_results import module_results

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="tf.distribute runs on the TensorFlow backend only",
)

CACHE, BATCH, STEPS = 40, 16, 12
CASES = [("dense", "sgd"), ("dense", "adagrad"), ("collection", "adagrad")]


# ---------------------------------------------------------------- subprocess
def _data(seed=0):
    return cached_tables.data(BATCH, STEPS, seed)


def _model(kind, optimizer, cache):
    keras.utils.set_random_seed(3)
    model, layer = cached_tables.build(kind, optimizer, cache)
    model.compile(optimizer="sgd", loss="mse")
    return model, layer


def _copies_gap(cache):
    """Largest difference between the replicas' copies of the cache."""
    gap = 0.0
    for var in [cache.embeddings, *cache.slots.values()]:
        copies = [np.asarray(c) for c in var._value.values]
        assert len(copies) == 2
        gap = max(gap, float(np.abs(copies[0] - copies[1]).max()))
    return gap


def _train(kind, optimizer, cache, start):
    model, layer = _model(kind, optimizer, cache)
    start = cached_tables.start_from(model, layer, kind, start)
    x, y = _data()
    x = x["a"] if kind == "dense" else x
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    probe = _data(1)[0]
    predicted = model.predict(probe["a"] if kind == "dense" else probe, verbose=0)
    out = {"stats": None, "copies": None}
    if cache:
        caches = layer.table_caches if kind == "collection" else {"a": layer.row_cache}
        out["stats"] = caches["a"].stats()
        out["copies"] = _copies_gap(caches["a"])
    return cached_tables.state(kind, layer), predicted, out, start


def _gap(got, want, exact_keys):
    """``(exact, close)``: the largest differences of the entries that must
    match bit for bit and of the others."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    gaps = {k: float(np.abs(got[k] - want[k]).max()) for k in want}
    exact = max([v for k, v in gaps.items() if exact_keys(k)], default=0.0)
    close = max([v for k, v in gaps.items() if not exact_keys(k)], default=0.0)
    return exact, close


def _run():
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    cache = {"cache_rows": CACHE, "store": "host"}
    results = {}
    for kind, optimizer in CASES:
        with strategy.scope():
            got, got_pred, info, start = _train(kind, optimizer, cache, None)
            want, want_pred, _, _ = _train(kind, optimizer, {}, start)
        # A collection's uncached table "b" shares a stack with "a" only in
        # the reference: its updates sum in another order.
        exact, close = _gap(got, want, lambda k: not k.startswith("b:"))
        result = dict(info, exact=exact, close=close)
        result["predict"] = float(np.abs(got_pred - want_pred).max())
        if (kind, optimizer) == ("dense", "adagrad"):  # and one device
            with tf.device("/cpu:0"):
                one, one_pred, _, _ = _train(kind, optimizer, {}, start)
            result["one_device"] = _gap(got, one, lambda k: False)[1]
            result["one_device_predict"] = float(np.abs(got_pred - one_pred).max())
        results[f"{kind}-{optimizer}"] = result
    results["saved"] = _saved_and_failing(strategy)
    return results


def _saved_and_failing(strategy):
    """A model saved under the strategy, loaded on one device (largest
    difference of the tables and of predictions); then a batch with an id
    out of range: its error, the next step's error, whether the cache
    changed."""
    import tempfile

    import tensorflow as tf

    x, y = _data()
    probe = _data(1)[0]["a"]
    path = tempfile.mkdtemp() + "/m.keras"
    cache = {"cache_rows": CACHE, "store": "host"}
    out = {}
    with strategy.scope():
        model, layer = _model("dense", "adagrad", cache)
        model.fit(x["a"], y, batch_size=BATCH, shuffle=False, verbose=0)
        model.save(path)
        want, want_pred = layer.get_weights(), model.predict(probe, verbose=0)
        bad = x["a"][:BATCH].copy()
        bad[3, 1] = VOCAB
        before = layer.stats()
        for key, batch in (("bad", bad), ("next", x["a"][:BATCH])):
            try:
                model.fit(batch, y[:BATCH], batch_size=BATCH, verbose=0)
                out[key] = "trained"
            except Exception as e:  # noqa: BLE001  (TF wraps the error)
                out[key] = str(e)
        out["unchanged"] = layer.stats() == before
    with tf.device("/cpu:0"):
        loaded = keras.models.load_model(path)
        got = loaded.get_layer("ids").get_weights()
        out["tables"] = max(float(np.abs(a - b).max()) for a, b in zip(got, want))
        pred = loaded.predict(probe, verbose=0)
        out["predict"] = float(np.abs(pred - want_pred).max())
    return out


def _main():
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    print("RESULTS " + json.dumps(_run()))


if __name__ == "__main__":
    _main()


# --------------------------------------------------------------------- tests
@pytest.mark.parametrize("kind, optimizer", CASES)
def test_a_mirrored_cache_trains_as_the_whole_table(kind, optimizer):
    result = module_results(__file__, timeout=400)[f"{kind}-{optimizer}"]
    stats = result["stats"]
    # One map for both replicas: rows went down to the store and came back.
    assert stats["evictions"] >= 100 and stats["fills"] >= stats["evictions"], stats
    assert stats["write_backs"] == stats["evictions"], stats
    assert result["copies"] == 0.0  # the replicas' caches are identical
    assert result["exact"] == 0.0, result
    assert result["close"] <= 1e-7 and result["predict"] <= 1e-7, result
    if "one_device" in result:
        assert result["one_device"] <= 1e-6, result
        assert result["one_device_predict"] <= 1e-6, result


def test_a_model_saved_under_the_strategy_loads_on_one_device():
    result = module_results(__file__, timeout=400)["saved"]
    assert result["tables"] == 0.0 and result["predict"] <= 1e-6, result


def test_a_failed_step_fails_every_replica_and_the_next_steps():
    """An id out of range fails the step on every replica with the
    table's error, nothing moved; the replicas' later calls can no longer
    be paired up, so later steps raise rather than map wrong batches."""
    result = module_results(__file__, timeout=400)["saved"]
    assert f"Layer 'ids': id {VOCAB} is out of range" in result["bad"], result
    assert result["unchanged"], result
    assert "an earlier step failed in its cache mapping" in result["next"], result
