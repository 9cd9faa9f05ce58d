"""A hash layer over a row store, sharded on 8 devices (JAX), trains as
the same sharded layer with a table holding every key.

Data parallel: one host table, replicated variables; key sharded: a
table shard, a block of rows and a store per device. The reference is the
same model and distribution with a capacity no key is evicted from; every
key's record (values, slots, score) must match, and so must predictions
(which read evicted keys from the stores).
"""

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse import sharding
from keras_sparse.sharding import plan_cost
from keras_sparse.sharding.plan_spec import TableSpec
from tests import row_store_models as shared

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="sharding with a store is on JAX"
)

BATCH, STEPS = 64, 12


def _data():
    keys, target = shared.batches(0, 300, BATCH * STEPS // shared.BATCH)
    rng = np.random.default_rng(1)
    # A long tail in the second field: every shard keeps evicting.
    keys[:, 1] = rng.integers(0, 600, size=len(keys)) * 104_729 + 11
    return keys, target


def _train(capacity, store, eviction, optimizer, key_sharded, save_to=None):
    """(records, predictions, stats) of a model trained on 8 devices (saved
    to ``save_to`` when given)."""
    devices = keras.distribution.list_devices()
    assert len(devices) == 8, "run with --xla_force_host_platform_device_count=8"
    # Data parallel: the layer (its seed generator too) is made under the
    # distribution; key sharding plans the layer first.
    if not key_sharded:
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=devices)
        )
    keras.utils.set_random_seed(7)
    layer = ks.DistributedHashEmbedding(
        4,
        capacity=capacity,
        combiner="sum",
        optimizer=optimizer,
        eviction=eviction,
        store=store,
        sharding="key" if key_sharded else "data",
        name="ids",
    )
    if key_sharded:
        keras.distribution.set_distribution(sharding.distribution([layer], devices=8))
    keys, target = _data()
    try:
        inputs = keras.Input((shared.FIELDS,), dtype="int64")
        model = keras.Model(inputs, keras.layers.Dense(1)(layer(inputs)))
        model.compile(optimizer="sgd", loss="mse")
        model.fit(keys, target, batch_size=BATCH, shuffle=False, verbose=0)
        predicted = model.predict(keys[:BATCH], batch_size=BATCH, verbose=0)
        if save_to is not None:
            model.save(save_to)
    finally:
        keras.distribution.set_distribution(None)
    return shared.records(layer), predicted, layer.stats()


def _check_exact(cached, full):
    (got, got_pred, stats), (want, want_pred, full_stats) = cached, full
    assert stats["evictions"] >= 50 and stats["fills"] >= 20, stats
    assert stats["overflows"] == 0, stats  # every key of every step got a row
    assert full_stats["evictions"] == 0
    np.testing.assert_array_equal(got["keys"], want["keys"])
    np.testing.assert_array_equal(got["scores"], want["scores"])
    for name in want:
        if name not in ("keys", "scores"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    assert stats["store_size"] + stats["size"] == len(want["keys"])
    np.testing.assert_allclose(got_pred, want_pred, rtol=1e-5, atol=1e-6)


def test_data_parallel_store_matches_a_table_holding_every_key():
    # One host table maps the gathered batch; the moves run once per step
    # and every replica's variables get the same filled rows.
    full = _train(4096, None, "lru", "adagrad", key_sharded=False)
    cached = _train(256, "host", "lru", "adagrad", key_sharded=False)
    _check_exact(cached, full)


@pytest.mark.parametrize("eviction, optimizer", [("lru", "adagrad"), ("lfu", "sgd")])
def test_key_sharded_stores_match_shards_holding_every_key(
    eviction, optimizer, tmp_path
):
    full = _train(8192, None, eviction, optimizer, key_sharded=True)
    # 64 rows per shard (the least a shard has), a store per shard.
    path = tmp_path / "m.keras"
    cached = _train(512, "host", eviction, optimizer, True, save_to=path)
    _check_exact(cached, full)
    if eviction != "lru":
        return
    # Saved with the stores' keys; loaded on 4 devices, each key (in a
    # shard's table or store) goes to its new owner.
    model, _ = sharding.load_model(str(path), devices=4)
    try:
        layer = model.get_layer("ids")
        assert layer.table.num_shards == 4 and sorted(layer.row_tier.shards) == [
            0,
            1,
            2,
            3,
        ]
        stats = layer.stats()
        assert stats["store_size"] > 0 and stats["size"] > 0, stats
        got = shared.records(layer)
    finally:
        keras.distribution.set_distribution(None)
    want = cached[0]
    for name in ("keys", "values", "accumulator", "scores"):
        np.testing.assert_array_equal(got[name], want[name])


def test_key_sharded_store_keeps_each_key_in_its_owner_shard(tmp_path):
    layer = ks.DistributedHashEmbedding(
        4,
        capacity=512,
        optimizer="sgd",
        sharding="key",
        store=ks.store.Disk(str(tmp_path)),
        name="own",
    )
    keras.distribution.set_distribution(sharding.distribution([layer], devices=8))
    try:
        layer.build((None, 2))
    finally:
        keras.distribution.set_distribution(None)
    tier = layer.row_tier
    assert sorted(tier.shards) == list(range(8))
    # A folder per shard under the disk spec's path.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"own.shard{d}" for d in range(8)
    ]
    keys = np.arange(40, dtype=np.int64) * 7_919 + 5
    values = np.arange(160, dtype="float32").reshape(40, 4)
    rows = {"values": values, "score": np.ones((40, 1), np.int64)}
    tier.store.write(keys, rows)
    owners = ks.table.owner_of(keys, 8)
    for d, store in tier.store.stores.items():
        held = np.sort(np.concatenate([k for k, _ in store.chunks()] or [[]]))
        np.testing.assert_array_equal(held, np.sort(keys[owners == d]))
    found, got = tier.store.read(keys[::-1])
    assert found.all()
    np.testing.assert_array_equal(got["values"], values[::-1])


def test_key_sharded_store_refuses_eager_training_calls():
    layer = ks.DistributedHashEmbedding(
        4, capacity=512, optimizer="sgd", sharding="key", store="host", name="eager"
    )
    keras.distribution.set_distribution(sharding.distribution([layer], devices=8))
    try:
        layer.build((None, 2))
        with pytest.raises(ValueError, match="'eager'.*`store`.*compiled steps"):
            layer(np.array([[1, 2]] * 8), training=True)
        assert layer.table.size == 0  # refused before the table changed
    finally:
        keras.distribution.set_distribution(None)


def test_key_sharded_store_refuses_a_process_holding_some_shards():
    from keras_sparse.layers.row_storage import hash_store
    from keras_sparse.table import ShardedHashTable

    layer = ks.DistributedHashEmbedding(4, capacity=512, optimizer="sgd", name="part")
    layer.build()
    layer.table = ShardedHashTable(512, 8, local=(0, 1, 2, 3), device="cpu")
    with pytest.raises(
        ValueError, match="'part'.*`store`.*shards \\[0, 1, 2, 3\\] of 8"
    ):
        hash_store.attach(layer, ks.store.Host())


def test_planner_key_shards_hash_tables_with_a_store():
    spec = TableSpec("t", 10**6, 16, hash_keys=True, store="host", device_rows=4096)
    assert plan_cost.structural_problem(spec, "key", 8) is None
    assert "row store" in plan_cost.structural_problem(spec, "column", 8)
