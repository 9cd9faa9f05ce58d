"""The prefetch stage under model parallelism (JAX, 8 CPU devices).

Row-sharded hash layers with compact exchange buffers get their ids bucketed
by owner shard in the workers; training stays identical to the raw path, and
a batch that would overflow a buffer fails in the worker, before its step.
"""

import re

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse import sharding
from keras_sparse.data import prefetch
from keras_sparse.data.prefetch import PrefetchError
from keras_sparse.sharding import exchange_buckets
from keras_sparse.sharding import keras_integration

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="sharding is implemented for JAX"
)

D, CAPACITY, DIM, BAG, BATCH, STEPS = 8, 256, 8, 4, 64, 6
SLACK = 4.0  # 32 ids per device -> 16 slots per destination


def _layers(strategy="row"):
    return [
        ks.DistributedHashEmbedding(
            DIM, capacity=CAPACITY, combiner="sum", optimizer="adagrad",
            sharding=strategy, name="hashed",
        ),
        ks.DistributedHashEmbedding(
            DIM, capacity=64, combiner="mean", optimizer="sgd",
            sharding="data", name="small",
        ),
    ]  # fmt: skip


def _model(layers):
    hashed, small = layers
    a = keras.Input((BAG,), dtype="int32", name="keys")
    b = keras.Input((1,), dtype="int32", name="ctx")
    h = keras.layers.Concatenate()([hashed(a), small(b)])
    model = keras.Model([a, b], keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def _data(num_keys=600):
    rng = np.random.default_rng(11)
    n = BATCH * STEPS
    # Uniform over more keys than rows: evictions, and rows spread over the
    # shards (buckets well inside the slack).
    keys = rng.integers(0, num_keys, (n, BAG)) * 7_919 + 13
    ctx = rng.integers(0, 40, (n, 1))
    x = {"keys": keys.astype("int32"), "ctx": ctx.astype("int32")}
    return x, rng.normal(size=(n, 1)).astype("float32")


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def _under(strategy, slack, body):
    keras.utils.set_random_seed(21)  # the same initial model every time
    layers = _layers(strategy)
    dist = sharding.distribution(layers, devices=D, row_exchange_slack=slack)
    keras.distribution.set_distribution(dist)
    try:
        return body(_model(layers))
    finally:
        keras.distribution.set_distribution(None)


def test_row_sharded_stage_buckets_and_trains_identically(monkeypatch):
    x, y = _data()
    calls = []
    original = keras_integration.ExchangeBuckets.slots

    def spy(self, rows, name):
        out = original(self, rows, name)
        calls.append((rows.shape, out.shape, int(out.max())))
        return out

    monkeypatch.setattr(keras_integration.ExchangeBuckets, "slots", spy)
    keras.utils.set_random_seed(5)
    init = _weights(_model(_layers("data")))

    def raw(model):
        model.set_weights(init)
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        assert model.get_layer("hashed").stats()["evictions"] > 0
        return _weights(model)

    def staged(bucket):
        def body(model):
            model.set_weights(init)
            with prefetch(
                (x, y), model, batch_size=BATCH, threads=2, bucket=bucket
            ) as stage:
                hashed = model.get_layer("hashed")
                layout = hashed.prepared_form.layout
                if bucket:
                    assert layout[0] == D
                    assert layout[1] == keras_integration.exchange_buckets(hashed)
                    assert layout[1].capacity(BATCH * BAG) == 16
                else:
                    assert layout is None
                # The replicated layer keeps its segments.
                assert model.get_layer("small").prepared_form.layout == (D, "segments")
                model.fit(stage, epochs=1, verbose=0)
            return _weights(model)

        return body

    want = _under("row", SLACK, raw)
    assert not calls
    got = _under("row", SLACK, staged(True))
    assert len(calls) == STEPS
    assert all(c[0] == (BATCH, BAG) and c[1] == (BATCH, BAG) for c in calls)
    assert max(c[2] for c in calls) < 16
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    calls.clear()
    plain = _under("row", SLACK, staged(False))
    assert not calls
    for a, b in zip(want, plain):
        np.testing.assert_array_equal(a, b)


def test_inference_stages_with_buckets_match_the_raw_path():
    x, y = _data()

    def run(staged):
        def body(model):
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
            if not staged:
                loss = model.evaluate(x, y, batch_size=BATCH, verbose=0)
                return loss, model.predict(x, batch_size=BATCH, verbose=0)
            with prefetch((x, y), model, batch_size=BATCH, training=False) as st:
                layout = model.get_layer("hashed").prepared_form.layout
                assert isinstance(layout[1], keras_integration.ExchangeBuckets)
                loss = model.evaluate(st, verbose=0)
            with prefetch(x, model, batch_size=BATCH, training=False) as st:
                return loss, model.predict(st, verbose=0)

        return body

    want, got = _under("row", SLACK, run(False)), _under("row", SLACK, run(True))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-7)


def test_overflowing_bucket_fails_in_the_worker_and_rolls_back():
    # Keys whose rows (found with a throwaway table of the same capacity) lie
    # in shard 0: every device's 32 ids go to one owner, past its 16 slots.
    probe = ks.DistributedHashEmbedding(DIM, capacity=CAPACITY, optimizer="sgd")
    probe.build()
    candidates = np.arange(200) + 1000
    rows = probe.map_host_keys(candidates, np.ones(200, bool), True).rows
    hot = candidates[np.asarray(rows).reshape(-1) < CAPACITY // D]
    keys = np.resize(hot, BATCH * BAG).reshape(BATCH, BAG).astype("int32")
    x = {"keys": keys, "ctx": np.zeros((BATCH, 1), "int32")}
    y = np.zeros((BATCH, 1), "float32")

    def body(model):
        hashed = model.get_layer("hashed")
        before = _weights(model)
        with prefetch((x, y), model, batch_size=BATCH) as stage:
            with pytest.raises(PrefetchError) as info:
                model.fit(stage, epochs=1, verbose=0)
        error = info.value.original
        assert isinstance(error, exchange_buckets.ExchangeOverflowError)
        # Each device sends its distinct keys' rows once.
        worst = max(len(set(k.tolist())) for k in keys.reshape(D, -1))
        assert worst > 16
        assert re.search(
            f"layer 'hashed'.*{worst} distinct ids for one owner.*16 exchange "
            "slots.*batch, before its step, was aborted",
            str(error),
        )
        for a, b in zip(before, _weights(model)):  # no step ran
            np.testing.assert_array_equal(a, b)
        assert int(np.asarray(hashed.sparse_iterations.value)) == 0
        assert hashed.stats()["size"] == 0  # the stage erased the batch's keys

    _under("row", SLACK, body)


@pytest.mark.parametrize("strategy, slack", [("row", None), ("column", SLACK)])
def test_layers_without_compact_row_buffers_get_codes_alone(strategy, slack):
    x, y = _data()

    def body(model):
        with prefetch((x, y), model, batch_size=BATCH) as stage:
            assert model.get_layer("hashed").prepared_form.layout is None
            model.fit(stage, epochs=1, steps_per_epoch=2, verbose=0)

    _under(strategy, slack, body)


def test_stage_made_under_another_distribution_is_refused():
    x, y = _data()
    layers = _layers("row")
    dist = sharding.distribution(layers, devices=D, row_exchange_slack=SLACK)
    keras.distribution.set_distribution(dist)
    try:
        model = _model(layers)
        stage = prefetch((x, y), model, batch_size=BATCH)
        other = sharding.distribution(layers, devices=D, row_exchange_slack=2.0)
        keras.distribution.set_distribution(other)
        with pytest.raises(ValueError, match="'hashed'.*bucketed its ids for"):
            model.fit(stage, epochs=1, steps_per_epoch=1, verbose=0)
        stage.close()
    finally:
        keras.distribution.set_distribution(None)
