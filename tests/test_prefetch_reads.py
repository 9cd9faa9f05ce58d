"""Read-only calls, exports and stray keys while a prefetch stage holds a layer.

A training stage maps batches into the hash table before their steps run.
A read-only call (``layer(keys, training=False)``) or ``layer.export()``
made meanwhile, e.g. from a callback, must see the model as of the last
trained step, as the same run without the stage does at that step: keys
that only batches in flight inserted read zeros, keys they evicted read
their trained vector (from the row they left, or from the row store). Keys
passed where the stage's codes are expected raise, naming the layer.
"""

import time

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse.data import prefetch

N, BATCH, AT = 240, 24, (2, 5)  # 10 steps; reads after steps 3 and 6
PROBE = np.arange(300, dtype=np.int64)[:, None]  # every key, one per row


def _model(store):
    keras.utils.set_random_seed(3)
    inp = keras.Input((2,), dtype="int32")
    layer = ks.DistributedHashEmbedding(
        4, capacity=64, combiner="sum", optimizer="adagrad", eviction="lru",
        store=store, name="h",
    )  # fmt: skip
    model = keras.Model(inp, keras.layers.Dense(1)(layer(inp)))
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model, layer


def _data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 300, (N, 2)).astype(np.int32)  # 300 keys, 64 rows
    return x, rng.normal(size=(N, 1)).astype(np.float32)


class _Reader(keras.callbacks.Callback):
    """After steps ``AT``, waits until the stage (if any) mapped two more
    batches, then reads every key and exports the layer, reaching the
    layer directly (not through ``self.model``) where a stage is open."""

    def __init__(self, layer, stage):
        super().__init__()
        self.layer, self.stage, self.seen = layer, stage, {}

    def on_train_batch_end(self, batch, logs=None):
        if batch not in AT:
            return
        layer = self.layer
        mapped = None
        if self.stage is None:
            assert self.model is not None  # re-attaches what a JAX fit holds
        else:
            p = self.stage._engine._pass
            deadline = time.time() + 10
            while time.time() < deadline and p.turn[p.lane[0]] < batch + 3:
                time.sleep(0.01)
            assert p.turn[p.lane[0]] >= batch + 3  # batches in flight
            mapped = layer.table.lookup(PROBE[:, 0], count=False)
        out = keras.ops.convert_to_numpy(layer(PROBE, training=False))
        self.seen[batch] = (out, layer.export(), mapped)


def _run(staged, store=None):
    x, y = _data()
    model, layer = _model(store() if store else None)
    if not staged:
        reader = _Reader(layer, None)
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[reader])
        return reader.seen
    with prefetch((x, y), model, batch_size=BATCH, threads=2, capacity=4) as st:
        reader = _Reader(layer, st)
        model.fit(st, verbose=0, callbacks=[reader])
    return reader.seen


@pytest.mark.parametrize("store", [None, ks.store.Host], ids=["table", "store"])
def test_reads_and_exports_mid_stage_are_those_of_the_trained_step(store):
    plain, staged = _run(False, store), _run(True, store)
    inflight_new = inflight_evicted = 0
    for batch in AT:
        want, want_export, _ = plain[batch]
        got, got_export, mapped = staged[batch]
        # The dict of the trained table: which keys read a vector.
        trained = set(want_export["keys"].tolist())
        has_vector = np.abs(got).sum(-1) > 0
        assert has_vector.tolist() == [k in trained for k in range(len(PROBE))]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        for name in want_export:
            np.testing.assert_allclose(
                got_export[name], want_export[name], rtol=1e-6, atol=1e-7
            )
        # The stage had mapped keys the trained step does not hold yet, and
        # evicted keys it holds (in its table, or its store).
        inflight_new += int(np.sum((mapped >= 0) & ~has_vector))
        inflight_evicted += int(np.sum((mapped < 0) & has_vector))
    assert inflight_new > 0 and inflight_evicted > 0


def test_keys_where_codes_are_expected_raise_naming_the_layer():
    x, y = _data()
    model, layer = _model(None)
    with prefetch((x, y), model, batch_size=BATCH, capacity=2):
        with pytest.raises(ValueError, match="Layer 'h'.*prefetch stage.*codes"):
            layer(np.array([[5, 7]]), training=True)  # NumPy keys, training
        wide = keras.ops.convert_to_tensor(np.full((4, 2), 1000, np.int32))
        for training in (True, False):  # values no code takes
            with pytest.raises(ValueError, match="Layer 'h'.*received values"):
                model(wide, training=training)
        small = keras.ops.convert_to_tensor(np.array([[3, 7, 9]], np.int32))
        with pytest.raises(ValueError, match="Layer 'h'.*does not fit that layout"):
            layer(small)  # in range, but not laid out as the stage's codes
        # Read-only NumPy keys read as the (untrained) model: nothing yet.
        out = keras.ops.convert_to_numpy(layer(np.array([[5, 7]]), training=False))
        assert not out.any()
    # Closed: keys are keys again.
    assert keras.ops.convert_to_numpy(layer(np.array([[5, 7]]), training=True)).any()


@pytest.mark.parametrize("ttl_steps", [None, 2])
def test_rows_before_untrained_calls_match_the_table_state_before_them(ttl_steps):
    """Rows as of before a few evicting (and expiring) calls (keys
    re-inserted elsewhere, evicted or expired twice, expired rows reused)
    equal a dict of `state_before`'s entries."""
    from keras_sparse.layers.hash.trained_rows import rows_before
    from keras_sparse.table import HashTable

    rng = np.random.default_rng(1)
    table = HashTable(96, eviction="lru", device="cpu", ttl_steps=ttl_steps)
    table.lookup_or_insert(rng.integers(0, 400, 50))
    log = []
    for _ in range(5):  # each call evicts some keys, some come back
        table.lookup_or_insert_fresh(rng.integers(0, 400, 40), undo=log)
    assert sum(len(r.evicted_keys) for r in log) > 20
    if ttl_steps is not None:  # and expired keys of the first calls
        assert sum(len(r.ttl.expired_keys) for r in log) > 20
    state = table.state_before(log)
    want = dict(zip(state.keys.tolist(), state.rows.tolist()))
    keys = np.arange(400, dtype=np.int64)
    got = rows_before(table.lookup(keys, count=False), keys, log)
    assert got.tolist() == [want.get(k, -1) for k in keys.tolist()]
    now = table.lookup(keys, count=False)
    assert (now != got).sum() > 20  # the calls moved many keys
