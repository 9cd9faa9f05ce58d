"""Delta exports: ``layer.export(since_step=s)``, `apply_delta`, checkpoints
and the `DeltaExport` callback.

Reference: the layer's plain ``export()`` at the end (keys sorted), and a
dict model of which keys each step saw and which keys the table held.
"""

import os

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse.layers.hash.deltas import META

DIM, BAG, BATCH = 4, 3, 16


def _layer(name="user", **kwargs):
    args = dict(
        capacity=128,
        combiner="sum",
        optimizer="adagrad",
        ttl_steps=3,
        track_changes=True,
        name=name,
    )
    args.update(kwargs)
    return ks.DistributedHashEmbedding(DIM, **args)


def _model(layer):
    keys = keras.Input((BAG,), dtype="int64", name="keys")
    out = keras.layers.Dense(1)(layer(keys))
    model = keras.Model(keys, out)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def _batches(steps, seed, vocab=250):
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, vocab, size=(steps * BATCH, BAG)).astype(np.int64)
    keys = keys * 7_919_993_123 - (3 << 40)  # beyond int32
    return keys, rng.normal(size=(steps * BATCH, 1)).astype("float32")


def _fit(model, keys, y):
    model.fit(keys, y, batch_size=BATCH, shuffle=False, verbose=0)


def _by_key(records):
    order = np.argsort(records["keys"], kind="stable")
    names = set(records) - set(META)
    return {n: np.asarray(records[n])[order] for n in names}


def _assert_same(got, want):
    got, want = _by_key(got), _by_key(want)
    assert sorted(got) == sorted(want)
    for name in want:  # bit-exact: the same vectors, slots, scores
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_deltas_applied_in_order_reproduce_the_table():
    """full(4) + delta(4, 7) + delta(7, 10) == full(10), with evictions
    (64 rows, 150 keys), TTL expiry and Adagrad slots; each delta holds
    exactly the live keys seen after its start, and removes the keys
    gone since."""
    layer = _layer()
    model = _model(layer)
    keys, y = _batches(10, seed=0)
    held, chain = [], []
    for lo, hi in ((0, 4), (4, 7), (7, 10)):
        _fit(model, keys[lo * BATCH : hi * BATCH], y[lo * BATCH : hi * BATCH])
        since = -1 if lo == 0 else int(chain[-1]["step"])
        chain.append(layer.export(since_step=since))
        held.append(set(layer.export()["keys"].tolist()))
        assert int(chain[-1]["step"]) == hi
    stats = layer.stats()
    assert stats["evictions"] > 0 and stats["expired"] > 0
    for i, (lo, hi) in enumerate(((4, 7), (7, 10)), start=1):
        seen = set(keys[lo * BATCH : hi * BATCH].ravel().tolist())
        delta = chain[i]
        assert set(delta["keys"].tolist()) == seen & held[i]
        removed = set(delta["removed_keys"].tolist())
        assert removed and not removed & held[i]
        assert held[i - 1] - held[i] <= removed <= (held[i - 1] | seen) - held[i]
        assert len(delta["keys"]) < len(held[i])  # a delta, not a full copy
    applied = ks.apply_delta(chain[0], chain[1], chain[2])
    _assert_same(applied, layer.export())
    assert int(applied["step"]) == 10
    with pytest.raises(ValueError, match=r"'user'.*since_step.*\[0, 10\]"):
        layer.export(since_step=11)
    with pytest.raises(ValueError, match="'plain'.*track_changes=True"):
        _layer("plain", track_changes=False).export(since_step=0)
    with pytest.raises(ValueError, match="track_changes"):
        _layer("bad", track_changes="yes")
    # The chain refuses a delta applied twice, skipped or to another layer.
    with pytest.raises(ValueError, match=r"covers steps \(7, 10\].*at step 4"):
        ks.apply_delta(chain[0], chain[2])
    other = dict(chain[1], layer=np.str_("item"))
    with pytest.raises(ValueError, match="layer 'item'.*layer 'user'"):
        ks.apply_delta(chain[0], other)


def test_a_row_store_keeps_evicted_keys_in_the_records():
    """Evicted keys go down to the store: still records, not removed; a
    delta holds those evicted after its start (with their last vectors)."""
    layer = _layer(capacity=64, ttl_steps=None, store=ks.store.Host())
    model = _model(layer)
    keys, y = _batches(6, seed=5)
    _fit(model, keys[: 3 * BATCH], y[: 3 * BATCH])
    base = layer.export(since_step=-1)
    _fit(model, keys[3 * BATCH :], y[3 * BATCH :])
    delta = layer.export(since_step=3)
    assert layer.stats()["evictions"] > 0 and len(delta["removed_keys"]) == 0
    assert len(layer.export()["keys"]) > layer.table.size  # some in the store
    _assert_same(ks.apply_delta(base, delta), layer.export())


def _files(directory):
    return sorted(os.listdir(directory))


def test_delta_export_callback_chains_across_save_and_load(tmp_path):
    """`DeltaExport` writes a full file, then a delta every 3 steps and at
    the end of fit, atomically (no temporary file left); after a `.keras`
    save and load (change steps and removed keys kept) a new callback
    continues the chain, which reads back into the final table. A file
    applied out of order is refused."""
    layer = _layer()
    model = _model(layer)
    keys, y = _batches(9, seed=2)
    folder = tmp_path / "deltas"
    model.fit(
        keys[: 5 * BATCH],
        y[: 5 * BATCH],
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[ks.callbacks.DeltaExport(folder, every_n_steps=3)],
    )
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    again = loaded.get_layer("user")
    assert again.table.track_changes
    loaded.fit(
        keys[5 * BATCH :],
        y[5 * BATCH :],
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[ks.callbacks.DeltaExport(folder, every_n_steps=3)],
    )
    names = _files(folder)
    assert names == [
        "user.00000000.full.npz",
        "user.00000003.delta.npz",
        "user.00000005.delta.npz",  # the end of the first fit
        "user.00000008.delta.npz",  # after the load
        "user.00000009.delta.npz",
    ]
    files = [dict(np.load(folder / n)) for n in names]
    assert str(files[3]["layer"]) == "user" and int(files[3]["since_step"]) == 5
    assert str(files[3]["dtype"]) == "float32"
    assert sum(len(f["removed_keys"]) for f in files[3:]) > 0
    _assert_same(ks.callbacks.DeltaExport.read(folder, "user"), again.export())
    with pytest.raises(ValueError, match="apply deltas in order"):
        ks.apply_delta(files[0], files[2])


def test_collection_exports_and_applies_per_field():
    """One delta per field, applied field by field (table calls stand in
    for training steps: the layer-level tests above train)."""
    fields = {n: _layer(n, ttl_steps=None) for n in ("user", "item")}
    collection = ks.HashEmbeddingCollection(fields)
    rng = np.random.default_rng(3)

    def step():
        for layer in fields.values():
            layer.table.lookup_or_insert(rng.integers(0, 10**6, size=100))

    step()
    base = collection.export(since_step=-1)
    step()
    delta = collection.export(since_step=1)
    assert sorted(delta) == ["item", "user"]
    assert 0 < len(delta["user"]["keys"]) < len(fields["user"].export()["keys"])
    assert len(delta["user"]["removed_keys"]) > 0  # 128 rows, 200 keys
    applied = ks.apply_delta(base, delta)
    for name, layer in fields.items():
        _assert_same(applied[name], layer.export())
    with pytest.raises(ValueError, match="fields"):
        ks.apply_delta(base, {"user": delta["user"]})


@pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="sharding is implemented for JAX"
)
def test_key_sharded_layer_on_eight_devices_chains_its_deltas():
    """8 table shards: expiry per shard; the deltas of every shard together
    reproduce the whole table."""
    from keras_sparse import sharding
    from keras_sparse.table import ShardedHashTable

    layer = _layer(sharding="key")
    keras.distribution.set_distribution(sharding.distribution([layer], devices=8))
    try:
        model = _model(layer)
        keys, y = _batches(7, seed=4)
        _fit(model, keys[: 4 * BATCH], y[: 4 * BATCH])
        base = layer.export(since_step=-1)
        _fit(model, keys[4 * BATCH :], y[4 * BATCH :])
        delta = layer.export(since_step=4)
    finally:
        keras.distribution.set_distribution(None)
    assert isinstance(layer.table, ShardedHashTable) and layer.table.num_shards == 8
    assert layer.stats()["expired"] > 0 and len(delta["removed_keys"]) > 0
    seen = set(keys[4 * BATCH :].ravel().tolist())
    assert set(delta["keys"].tolist()) == seen & set(layer.export()["keys"].tolist())
    _assert_same(ks.apply_delta(base, delta), layer.export())


@pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="host-side stage logic, the same on every backend (torch: cheapest)",
)
def test_prefetch_stage_files_equal_the_unstaged_run_step_by_step(tmp_path):
    """With `ks.data.prefetch` mapping batches ahead of their steps (clock,
    evictions and expiry ahead of training), `DeltaExport` writes files at
    the same steps as the run without the stage, and each prefix of the
    chain applies to the same records."""
    n = 8 * BATCH
    keys = _batches(8, seed=6)[0][:, :BAG]
    y = np.random.default_rng(6).normal(size=(n, 1)).astype("float32")
    chains = []
    for staged in (False, True):
        keras.utils.set_random_seed(11)
        model = _model(_layer(capacity=64, ttl_steps=2))
        folder = tmp_path / f"staged{staged}"
        callback = ks.callbacks.DeltaExport(folder, every_n_steps=2)
        if staged:
            feed = ks.data.prefetch((keys, y), model, batch_size=BATCH, capacity=4)
            with feed as stage:
                model.fit(stage, verbose=0, callbacks=[callback])
        else:
            _fit_with(model, keys, y, callback)
        names = _files(folder)
        files = [dict(np.load(folder / name)) for name in names]
        chains.append((names, [ks.apply_delta(*files[: i + 1]) for i in range(5)]))
    assert chains[0][0] == chains[1][0] and len(chains[0][0]) == 5
    for plain, staged in zip(chains[0][1], chains[1][1]):
        _assert_same(staged, plain)


def _fit_with(model, keys, y, callback):
    model.fit(keys, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[callback])


def test_forgetting_removals_bounds_the_log_and_keeps_later_deltas_exact(tmp_path):
    """`DeltaExport(forget_removals=True)` drops the removed-key log up to
    each file: the log holds only removals after the newest file (fewer
    than the removals seen), the chain still reads back into the final
    table, and deltas since an earlier step are refused."""
    layer = _layer(capacity=64)
    model = _model(layer)
    keys, y = _batches(9, seed=4, vocab=400)
    folder = tmp_path / "deltas"
    callback = ks.callbacks.DeltaExport(folder, every_n_steps=2, forget_removals=True)
    model.fit(keys, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[callback])
    from keras_sparse.table import change_keys

    stats = layer.stats()
    removals = stats["evictions"] + stats["expired"]
    gone, steps = change_keys.removed_keys(layer.table)
    assert removals > 0 and len(gone) < removals
    assert (steps > 9).all() or len(gone) == 0  # nothing at or before the last file
    _assert_same(ks.callbacks.DeltaExport.read(folder, "user"), layer.export())
    with pytest.raises(ValueError, match=r"'user'.*since_step.*\[9, 9\]"):
        layer.export(since_step=8)
    with pytest.raises(ValueError, match=r"'user'.*forget_removals.*\[9, 9\]"):
        layer.forget_removals(3)
    with pytest.raises(ValueError, match="forget_removals"):
        ks.callbacks.DeltaExport(folder, 2, forget_removals="yes")
