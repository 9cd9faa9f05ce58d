"""`DistributedHashEmbedding(ttl_steps=...)` in training, with the input
stage, through checkpoints, and key-sharded on 8 devices (JAX).

References: a dict model of the keys' last-seen steps (one step per
training batch), the same fit without `keras_sparse.data.prefetch`, an
uninterrupted run for a resumed one, and the layer on one device.
"""

import time

import h5py
import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse.data import prefetch

TTL, BATCH, STEPS, SAVE_AFTER = 2, 8, 8, 6


def _model():
    keras.utils.set_random_seed(3)
    keys = keras.Input((2,), dtype="int32", name="keys")
    layer = ks.DistributedHashEmbedding(
        4, capacity=256, combiner="sum", optimizer="adagrad", ttl_steps=TTL,
        name="h",
    )  # fmt: skip
    model = keras.Model(keys, keras.layers.Dense(1)(layer(keys)))
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


def _data():
    """Keys drifting batch by batch (some come back after expiring)."""
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [rng.integers(3 * s, 3 * s + 14, (BATCH, 2)) for s in range(STEPS)]
    ).astype(np.int32)
    x[::BATCH, 0] = 1  # key 1 in every batch: never expires
    return x, rng.normal(size=(len(x), 1)).astype(np.float32)


def _ttl_model(x, steps):
    """``(live keys with their last-seen steps, expired count)`` after the
    first ``steps`` batches."""
    seen, expired = {}, 0
    for s in range(1, steps + 1):
        gone = [k for k, t in seen.items() if t < s - TTL]
        expired += len(gone)
        for k in gone:
            del seen[k]
        for k in x[(s - 1) * BATCH : s * BATCH].ravel().tolist():
            seen[k] = s
    return seen, expired


class _SaveAt(keras.callbacks.Callback):
    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == SAVE_AFTER:
            self.model.save_weights(self.path)


def _entries(path):
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda n, o: (
                out.__setitem__(n, np.array(o)) if isinstance(o, h5py.Dataset) else None
            )
        )
    return out


def _records(model):
    rec = model.get_layer("h").export(include_rows=True)
    order = np.argsort(rec["keys"])
    return {name: np.asarray(v)[order] for name, v in rec.items()}


def _assert_same(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The fit without and with the input stage, each saving after step 6."""
    x, y = _data()
    folder = tmp_path_factory.mktemp("ttl")
    plain = _model()
    plain.fit(
        x, y, batch_size=BATCH, shuffle=False, verbose=0,
        callbacks=[_SaveAt(str(folder / "plain.weights.h5"))],
    )  # fmt: skip
    staged = _model()
    with prefetch((x, y), staged, batch_size=BATCH, threads=2, capacity=4) as st:
        staged.fit(
            st, verbose=0, callbacks=[_SaveAt(str(folder / "staged.weights.h5"))]
        )
    return x, y, folder, plain, staged


def test_fit_expires_keys_unseen_for_ttl_steps(runs):
    x, _, _, plain, _ = runs
    want, expired = _ttl_model(x, STEPS)
    layer = plain.get_layer("h")
    keys, _, _ = layer.table.export()
    assert sorted(keys.tolist()) == sorted(want)
    assert layer.stats()["expired"] == expired > 10
    assert 1 in want  # seen every step


def test_input_stage_expires_exactly_as_unstaged(runs):
    _, _, folder, plain, staged = runs
    _assert_same(_records(staged), _records(plain))
    assert staged.get_layer("h").stats() == plain.get_layer("h").stats()
    for w, v in zip(plain.weights, staged.weights):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(w), keras.ops.convert_to_numpy(v)
        )
    # The stage had mapped later batches when it saved: the save still
    # holds the last-seen steps as of step 6.
    want, got = (_entries(str(folder / f"{n}.weights.h5")) for n in ("plain", "staged"))
    assert sorted(want) == sorted(got)
    for name in want:
        np.testing.assert_array_equal(want[name], got[name], err_msg=name)
    entry = next(n for n in want if n.endswith("ttl_last_seen"))
    keys = want[entry.replace("ttl_last_seen", "record_keys")]
    seen, _ = _ttl_model(runs[0], SAVE_AFTER)
    assert want[entry].tolist() == [seen[k] for k in keys.tolist()]


def test_resumed_fit_expires_like_the_uninterrupted_one(runs):
    """Loaded keys keep their last-seen steps: those last seen before the
    save expire at the same later steps."""
    x, y, folder, plain, _ = runs
    seen, _ = _ttl_model(x, SAVE_AFTER)
    rest = slice(SAVE_AFTER * BATCH, None)
    later = set(x[rest].ravel().tolist())
    # Keys a load-step stamp would keep alive, but which expire in time.
    assert [k for k, t in seen.items() if t < SAVE_AFTER - 1 and k not in later]
    model = _model()
    model.load_weights(str(folder / "plain.weights.h5"))
    model.fit(x[rest], y[rest], batch_size=BATCH, shuffle=False, verbose=0)
    _assert_same(_records(model), _records(plain))


def test_expired_key_returns_fresh_and_argument_checks():
    layer = ks.DistributedHashEmbedding(
        4, capacity=64, optimizer="adagrad", ttl_steps=1, name="h1"
    )
    first = keras.ops.convert_to_numpy(layer(np.array([[7]]), training=True))
    layer.embeddings.assign(np.ones(layer.embeddings.shape, "float32"))
    layer(np.array([[8]]), training=True)
    assert keras.ops.convert_to_numpy(layer(np.array([[7]]))).sum() == 4  # still
    layer(np.array([[9]]), training=True)  # 7 expires (inference did not refresh)
    assert layer.stats()["expired"] == 1
    back = keras.ops.convert_to_numpy(layer(np.array([[7]]), training=True))
    np.testing.assert_array_equal(back, first)  # a new key's first vector
    config = layer.get_config()
    assert config["ttl_steps"] == 1
    assert ks.DistributedHashEmbedding.from_config(config).table.ttl_steps == 1
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=r"Layer 'h2'.*`ttl_steps`.*>= 1"):
            ks.DistributedHashEmbedding(4, capacity=64, ttl_steps=bad, name="h2")
    with pytest.raises(ValueError, match=r"Layer 'h3'.*`ttl_steps`.*`store=`"):
        ks.DistributedHashEmbedding(
            4, capacity=64, ttl_steps=3, store=ks.store.Host(), name="h3"
        )


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX key sharding")
def test_eight_devices_expire_like_the_model():
    """Key-sharded on 8 devices (one table shard each), keys expire at the
    steps the dict model gives, counted over the shards."""
    from tests.test_sharding_key import BATCH as SHARD_BATCH
    from tests.test_sharding_key import _data as shard_data
    from tests.test_sharding_key import _train

    _, eight = _train(8, {"ttl_steps": 1})
    assert eight.table.num_shards == 8 and eight.table.ttl_steps == 1
    keys = shard_data()[0][0]
    seen, expired = {}, 0
    for s in range(1, len(keys) // SHARD_BATCH + 1):
        gone = [k for k, t in seen.items() if t < s - 1]
        expired += len(gone)
        for k in gone:
            del seen[k]
        for k in keys[(s - 1) * SHARD_BATCH : s * SHARD_BATCH].ravel().tolist():
            seen[k] = s
    assert sorted(eight.table.export()[0].tolist()) == sorted(seen)
    assert eight.stats()["expired"] == expired > 0


def _wait_mapped(stage, batches):
    """Waits until ``stage``'s workers mapped its pass's first ``batches``."""
    p = stage._engine._pass
    deadline = time.time() + 10
    while time.time() < deadline and p.turn[p.lane[0]] < batches:
        time.sleep(0.01)
    assert p.turn[p.lane[0]] >= batches  # batches in flight


class _ReadAt(keras.callbacks.Callback):
    """After steps ``READ_AT`` (the stage, if any, two batches ahead), reads
    ``PROBE`` read-only and the table as the stage's table calls left it."""

    def __init__(self, layer, stage):
        super().__init__()
        self.layer, self.stage, self.seen = layer, stage, {}

    def on_train_batch_end(self, batch, logs=None):
        if batch not in READ_AT:
            return
        if self.stage is None:
            assert self.model is not None  # re-attaches what a JAX fit holds
        else:
            _wait_mapped(self.stage, batch + 3)
        mapped = self.layer.table.lookup(PROBE[:, 0], count=False)
        out = keras.ops.convert_to_numpy(self.layer(PROBE, training=False))
        self.seen[batch] = (out, mapped)


READ_AT, PROBE = (2, 4), np.arange(40, dtype=np.int64)[:, None]


def test_reads_mid_stage_find_keys_batches_in_flight_expired():
    """A read-only call from a callback while the stage mapped two batches
    ahead reads the keys those batches expired as the run without the
    stage does at that step: trained vectors, not zeros."""
    x, y = _data()
    runs = []
    for staged in (False, True):
        model = _model()
        layer = model.get_layer("h")
        if staged:
            with prefetch((x, y), model, batch_size=BATCH, threads=2, capacity=4) as st:
                reader = _ReadAt(layer, st)
                model.fit(st, verbose=0, callbacks=[reader])
        else:
            reader = _ReadAt(layer, None)
            model.fit(
                x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[reader]
            )
        runs.append(reader.seen)
    plain, staged = runs
    expired_ahead = 0
    for batch in READ_AT:
        want, in_plain = plain[batch]
        got, in_stage = staged[batch]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        # Keys the trained step holds that the batches in flight expired.
        expired_ahead += int(np.sum((in_plain >= 0) & (in_stage < 0)))
    assert expired_ahead > 5


def test_abandoned_batches_leave_clock_and_expired_keys_as_trained():
    """A fit with ``steps_per_epoch`` shorter than the stage's pass, then
    training on without the stage, ends as the unstaged fit of the same
    steps: the untrained batches neither advanced the clock nor expired
    keys."""
    x, y = _data()
    first = STEPS // 2 * BATCH
    plain = _model()
    for part in (slice(0, first), slice(first, None)):
        plain.fit(x[part], y[part], batch_size=BATCH, shuffle=False, verbose=0)
    model = _model()
    with prefetch((x, y), model, batch_size=BATCH, threads=2, capacity=4) as st:
        model.fit(st, steps_per_epoch=STEPS // 2, verbose=0)
        _wait_mapped(st, STEPS // 2 + 2)  # mapped, never trained
    layer = model.get_layer("h")
    seen, expired = _ttl_model(x, STEPS // 2)
    assert sorted(layer.table.export()[0].tolist()) == sorted(seen)
    assert layer.stats()["expired"] == expired
    model.fit(x[first:], y[first:], batch_size=BATCH, shuffle=False, verbose=0)
    _assert_same(_records(model), _records(plain))
    want, got = plain.get_layer("h").stats(), layer.stats()
    assert got["expired"] == want["expired"] == _ttl_model(x, STEPS)[1]
    assert got["size"] == want["size"]
    assert st.stats()["undone_calls"] >= 2
    for w, v in zip(plain.weights, model.weights):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(w), keras.ops.convert_to_numpy(v)
        )
