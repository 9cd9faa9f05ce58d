"""Key-sharded DistributedHashEmbedding (JAX, 8 virtual devices).

References: the same layer key-sharded on one device (a mesh of 1), the
plain single-device layer (fresh rows start per key in both), and
per-shard plain `HashTable`s fed the keys each owner receives (a model of
the per-shard eviction semantics).
"""

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse import sharding
from keras_sparse.table import HashTable
from keras_sparse.table import ShardedHashTable
from keras_sparse.table import owner_of
from tests.helpers import docs_code
from tests.helpers import fit_losses
from tests.test_admission_state import _sketch_estimates

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="sharding is implemented for JAX"
)

DIM, BAG, BATCH, STEPS = 4, 3, 32, 6

MULTI_DEVICE_PAGE = "docs/guides/multi-device.md"


def _layer(**kwargs):
    args = dict(
        capacity=1024,
        combiner="sum",
        optimizer="adagrad",
        sharding="key",
        name="hashed",
    )
    args.update(kwargs)
    return ks.DistributedHashEmbedding(DIM, **args)


def _data(num_keys=300, seed=0, weights=False, spread=False):
    rng = np.random.default_rng(seed)
    n = BATCH * STEPS
    ranks = np.minimum(rng.zipf(1.3, size=(n, BAG)), num_keys) - 1
    if spread:  # many distinct keys: evictions in small tables
        ranks = rng.integers(0, num_keys, size=(n, BAG))
    # Keys beyond int32: the step sees 32 bits, the tables the full keys.
    keys = ranks.astype(np.int64) * 7_919_993_123 + (5 << 33)
    keys[::4, 0] = keys[0, 0]  # a hot key on every device
    x = [keys]
    if weights:
        w = rng.uniform(0.5, 2.0, size=(n, BAG)).astype("float32")
        w[::3, 1] = 0.0  # padding: never inserted, never trained
        x.append(w)
    return x, rng.normal(size=(n, 1)).astype("float32")


def _model(layer, weights=False):
    keys = keras.Input((BAG,), dtype="int64", name="keys")
    inputs = [keys]
    if weights:
        w = keras.Input((BAG,), dtype="float32", name="w")
        inputs.append(w)
        pooled = layer(keys, weights=w)
    else:
        pooled = layer(keys)
    if layer.combiner is None:
        pooled = keras.layers.Flatten()(pooled)
    out = keras.layers.Dense(1, kernel_initializer="ones")(pooled)
    model = keras.Model(inputs, out)
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


def _train(devices, layer_kwargs, weights=False, data_kwargs=None):
    """Trains on ``devices`` (None: no distribution); (losses, layer)."""
    x, y = _data(weights=weights, **(data_kwargs or {}))
    layer = _layer(**layer_kwargs)
    if devices is not None:
        dist = sharding.distribution([layer], devices=devices)
        keras.distribution.set_distribution(dist)
    try:
        model = _model(layer, weights)
        losses = fit_losses(model, x if weights else x[0], y, BATCH)
        layer.__dict__["_test_model"] = model
        return losses, layer
    finally:
        keras.distribution.set_distribution(None)


def _by_key(layer):
    rec = layer.export()
    order = np.argsort(rec["keys"], kind="stable")
    return {name: np.asarray(value)[order] for name, value in rec.items()}


def _assert_same_records(got, want, atol=1e-6):
    np.testing.assert_array_equal(got["keys"], want["keys"])
    np.testing.assert_array_equal(got["scores"], want["scores"])
    for name in want:
        if name not in ("keys", "scores"):
            np.testing.assert_allclose(got[name], want[name], atol=atol, err_msg=name)


OPTIONS = {
    "sum": {},
    "mean": {"combiner": "mean"},
    "sqrtn_weights": {"combiner": "sqrtn", "_weights": True},
    "no_combiner_adam": {"combiner": None, "optimizer": "adam"},
    "admit_after_2": {"admit_after": 2},
    "lfu": {"eviction": "lfu"},
    "varscaling": {"embeddings_initializer": "glorot_uniform"},
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_eight_devices_match_one_device_key_by_key(option):
    kwargs = dict(OPTIONS[option])
    weights = kwargs.pop("_weights", False)
    ref_losses, ref = _train(1, kwargs, weights)
    losses, got = _train(8, kwargs, weights)
    assert isinstance(got.table, ShardedHashTable) and got.table.num_shards == 8
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=1e-5)
    want = _by_key(ref)
    assert len(want["keys"]) > 20
    _assert_same_records(_by_key(got), want)
    stats, ref_stats = got.stats(), ref.stats()
    for name in ("inserts", "rejected_admissions", "hits", "misses"):
        assert stats[name] == ref_stats[name], name
    if kwargs.get("admit_after") == 2:
        assert stats["rejected_admissions"] > 0


def test_admission_matches_one_device_with_keys_colliding_in_a_sketch():
    """400 keys seen once and 40 seen twice, admit_after=2: 8 devices and
    the plain one-device layer admit exactly the 40 (a count-min sketch of
    this capacity would have admitted some once-seen keys early)."""
    rng = np.random.default_rng(11)
    keys = rng.choice(2**40, size=440, replace=False).astype(np.int64) + (5 << 33)
    once, twice = keys[:400], keys[400:]
    flat = rng.permutation(np.concatenate([once, twice, twice]))
    x = flat.reshape(-1, BAG)
    y = np.zeros((len(x), 1), "float32")
    admitted = []
    for devices in (None, 8):
        layer = _layer(admit_after=2, sharding="auto" if devices is None else "key")
        if devices is not None:
            dist = sharding.distribution([layer], devices=devices)
            keras.distribution.set_distribution(dist)
        try:
            fit_losses(_model(layer), x, y, BATCH)
        finally:
            keras.distribution.set_distribution(None)
        admitted.append(np.sort(layer.export()["keys"]))
        if devices is None:
            seed = layer.table.seed
    np.testing.assert_array_equal(admitted[0], np.sort(twice))
    np.testing.assert_array_equal(admitted[1], np.sort(twice))
    times = np.r_[np.ones(400, np.int64), np.full(40, 2)]
    early = _sketch_estimates(keys, times, once, seed=seed) >= 2
    assert early.any()


@pytest.mark.parametrize("init", ["zeros", "uniform"])
def test_matches_the_plain_single_device_layer(init):
    """Key sharding trains exactly as the unsharded layer with its one table,
    initial values included (a key's first vector is a function of the
    layer seed and the key)."""
    kwargs = {"embeddings_initializer": init}
    ref_losses, ref = _train(None, kwargs)
    assert isinstance(ref.table, HashTable)
    losses, got = _train(8, kwargs)
    assert isinstance(got.table, ShardedHashTable)
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=1e-5)
    _assert_same_records(_by_key(got), _by_key(ref))


def _owner_batches(keys, devices):
    """What each owner's table receives per step: per source device, its
    distinct keys in first-occurrence order, each repeated by its count."""
    per_step = []
    for batch in keys.reshape(STEPS, BATCH * BAG):
        owners = [[] for _ in range(devices)]
        for local in batch.reshape(devices, -1):
            uniq, first, counts = np.unique(
                local, return_index=True, return_counts=True
            )
            order = np.argsort(first)
            for key, count in zip(uniq[order], counts[order]):
                owners[int(owner_of([key], devices)[0])] += [key] * int(count)
        per_step.append(owners)
    return per_step


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_eviction_under_pressure_is_per_shard(eviction):
    """More keys than rows: each shard evicts among its own keys, exactly
    as a plain table fed the owner's keys does."""
    kwargs = {"capacity": 512, "eviction": eviction}
    data = {"num_keys": 5000, "seed": 1, "spread": True}
    _, got = _train(8, kwargs, data_kwargs=data)
    assert got.stats()["evictions"] > 0
    models = [
        HashTable(got.table.shard_rows, eviction=eviction, device="cpu", seed=0)
        for _ in range(8)
    ]
    keys = _data(**data)[0][0]
    for owners in _owner_batches(keys, 8):
        for table, owned in zip(models, owners):
            table.lookup_or_insert(np.asarray(owned, np.int64))
    for d, table in enumerate(models):
        want_keys, want_rows, want_scores = table.export()
        got_keys, got_rows, got_scores = got.table.shard(d).export()
        order, want_order = np.argsort(got_keys), np.argsort(want_keys)
        np.testing.assert_array_equal(got_keys[order], want_keys[want_order])
        np.testing.assert_array_equal(got_rows[order], want_rows[want_order])
        np.testing.assert_array_equal(got_scores[order], want_scores[want_order])


def test_checkpoint_moves_between_device_counts(tmp_path):
    """8 -> 4 -> 1 -> 8 devices: keys, vectors, slots, scores and admission
    counts survive every move."""
    kwargs = {"admit_after": 2, "optimizer": "adam"}
    _, layer = _train(8, kwargs)
    want = _by_key(layer)
    pending = layer.table._impl.admission.state()
    assert len(pending[0])  # keys seen once are waiting for admission
    path = str(tmp_path / "m8.keras")
    layer.__dict__["_test_model"].save(path)
    for devices in (4, 1, 8):
        model, _ = sharding.load_model(path, devices=devices)
        try:
            layer = model.get_layer("hashed")
            assert getattr(layer.table, "num_shards", 1) == devices
            _assert_same_records(_by_key(layer), want, atol=0)
            # Pending admission counts are the same keys and counts.
            for a, b in zip(layer.table._impl.admission.state(), pending):
                np.testing.assert_array_equal(a, b)
            path = str(tmp_path / f"m{devices}.keras")
            model.save(path)
        finally:
            keras.distribution.set_distribution(None)


def test_dense_layers_refuse_key_sharding():
    with pytest.raises(ValueError, match="sharding.*'key'|Valid choices"):
        ks.AllToAllDenseEmbedding(10, 4, optimizer="adagrad", sharding="key")


def test_planner_prefers_key_sharding_for_hash_layers_across_processes():
    layer = _layer(sharding="auto")
    plan = sharding.plan([layer], devices=8, processes=2, strategies=sharding.RUNNABLE)
    assert plan.strategy("hashed") == "key"
    assert "one host key map per process" in plan["hashed"].reason
    # One process and a batch big enough: key sharding is also the cheaper.
    plan = sharding.plan([_layer(sharding="auto")], devices=8, batch_size=65536)
    assert plan.strategy("hashed") == "key", plan["hashed"].reason


def test_row_exchange_sends_distinct_keys_in_compact_buffers(monkeypatch):
    """With a slack the row lookup reuses the key exchange's packing: each
    device's distinct rows once per owner, in ``key_capacity`` slots (6 of
    the 12 positions per device here), their gradients summed on the
    sender; training and inference still equal one device's key by key."""
    from keras_sparse.sharding import jax_key_mapping
    from keras_sparse.sharding import jax_row_lookup

    real, seen = jax_row_lookup._row_forward, []

    def spy(mesh, axis, table, ids, valid, slack, given_slot, outputs, capacity=None):
        seen.append((capacity, given_slot is not None, ids.shape[0]))
        return real(mesh, axis, table, ids, valid, slack, given_slot, outputs, capacity)

    monkeypatch.setattr(jax_row_lookup, "_row_forward", spy)
    x, y = _data()
    x, y = x[0][: 2 * BATCH], y[: 2 * BATCH]  # 2 steps

    def train(devices, slack):
        layer = _layer()
        dist = sharding.distribution([layer], devices=devices, row_exchange_slack=slack)
        keras.distribution.set_distribution(dist)
        try:
            model = _model(layer)
            losses = fit_losses(model, x, y, BATCH)
            return losses, _by_key(layer), model.predict(x[:BATCH], verbose=0)
        finally:
            keras.distribution.set_distribution(None)

    ref_losses, ref, ref_out = train(1, None)
    assert all(cap is None or cap >= ids for cap, _, ids in seen), seen  # full
    seen.clear()
    losses, got, out = train(8, 4)
    n = BATCH * BAG // 8
    c = jax_key_mapping.key_capacity(n, 8, 4)
    assert c < n and seen and set(seen) == {(c, True, BATCH * BAG)}, seen
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=1e-5)
    _assert_same_records(got, ref, atol=1e-5)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)  # inference: same slots


def test_exchange_overflow_raises_before_tables_change():
    layer = _layer()
    dist = sharding.distribution([layer], devices=8, row_exchange_slack=0.01)
    keras.distribution.set_distribution(dist)
    try:
        model = _model(layer)
        x, y = _data()
        with pytest.raises(Exception, match="exchange slots"):
            float(model.train_on_batch(x[0][:BATCH], y[:BATCH]))
        # Later steps fail too, without touching the tables.
        with pytest.raises(Exception, match="exchange slots"):
            float(model.train_on_batch(x[0][:BATCH], y[:BATCH]))
        assert layer.table.size == 0
    finally:
        keras.distribution.set_distribution(None)


def test_a_process_holding_some_shards_imports_its_keys_and_refuses_to_save(
    tmp_path,
):
    """A process of a multi-process run (here: a table holding shards 0-3
    of 8) imports only the keys its shards own and never writes a
    checkpoint missing the other processes' keys."""
    layer = ks.DistributedHashEmbedding(
        DIM, capacity=1024, combiner="sum", optimizer="adagrad", name="hashed"
    )
    layer.build()
    layer.table = ShardedHashTable(1024, 8, local=(0, 1, 2, 3), device="cpu")
    assert layer.table.capacity == layer.num_rows
    keys = np.arange(200, dtype=np.int64) * 1_000_003
    values = np.random.default_rng(0).normal(size=(200, DIM)).astype("float32")
    mine = np.isin(owner_of(keys, 8), (0, 1, 2, 3))
    assert 0 < mine.sum() < 200
    assert layer.import_(keys, values) == mine.sum()
    got = _by_key(layer)
    np.testing.assert_array_equal(got["keys"], np.sort(keys[mine]))
    order = np.argsort(keys[mine])
    np.testing.assert_allclose(got["values"], values[mine][order])
    model = keras.Sequential([keras.Input((BAG,), dtype="int32"), layer])
    with pytest.raises(ValueError, match="shards \\[0, 1, 2, 3\\] of 8"):
        model.save(str(tmp_path / "partial.keras"))


def test_predict_reads_without_inserting():
    """Inference on 8 devices reads the shards (unknown keys read zeros,
    nothing is inserted) and matches one device."""
    x, _ = _data()
    unknown = x[0][:BATCH] + 12345  # never trained
    probe = np.concatenate([x[0][:BATCH], unknown])
    out = {}
    for devices in (1, 8):
        _, layer = _train(devices, {})
        model = layer.__dict__["_test_model"]
        size = layer.table.size
        dist = sharding.distribution([layer], devices=devices)
        keras.distribution.set_distribution(dist)
        try:
            out[devices] = model.predict(probe, batch_size=BATCH, verbose=0)
            pooled = model.get_layer("hashed")(unknown, training=False)
        finally:
            keras.distribution.set_distribution(None)
        assert layer.table.size == size
        np.testing.assert_array_equal(np.asarray(pooled), 0.0)
    np.testing.assert_allclose(out[8], out[1], atol=1e-6)


def test_docs_key_sharding_example_runs():
    """The multi-device guide's key-sharding example trains and holds keys."""
    code = docs_code(MULTI_DEVICE_PAGE, "## Key-sharded DistributedHashEmbedding")
    scope = {}
    try:
        exec(compile(code, MULTI_DEVICE_PAGE, "exec"), scope)
    finally:
        keras.distribution.set_distribution(None)
    items = scope["items"]
    assert isinstance(items.table, ShardedHashTable) and items.table.num_shards == 8
    assert items.stats()["size"] > 0


def test_layers_sharing_a_table_refuse_key_sharding():
    """Key sharding gives each layer its own sharded table: two layers that
    share one table are refused, naming both, instead of silently parting."""
    first, second = _layer(name="first"), _layer(name="second")
    second.table = first.table
    keras.distribution.set_distribution(
        sharding.distribution([first, second], devices=8)
    )
    try:
        keys = keras.Input((BAG,), dtype="int64")
        with pytest.raises(ValueError, match=r"'first'.*shared.*'second'"):
            keras.Model(keys, keras.layers.Add()([first(keys), second(keys)]))
    finally:
        keras.distribution.set_distribution(None)
    assert second.table is first.table
