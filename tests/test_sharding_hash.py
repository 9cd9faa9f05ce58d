"""A sharded DistributedHashEmbedding trains like one device (JAX).

More distinct keys than rows, so keys are evicted and rows re-initialized
(table and optimizer slots) inside sharded steps.
"""

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse import sharding
from keras_sparse.sharding import jax_exchange_bytes
from keras_sparse.sharding import jax_sharded_lookup
from keras_sparse.sharding import jax_sharded_reset
from keras_sparse.sharding import keras_integration
from tests.helpers import fit_losses

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="sharding is implemented for JAX"
)

CAPACITY, DIM, BAG, BATCH, STEPS = 64, 8, 3, 32, 20
NUM_KEYS = 400  # > CAPACITY: evictions and fresh rows every step


def _layers(strategy, optimizer):
    return [
        ks.DistributedHashEmbedding(
            DIM,
            capacity=CAPACITY,
            combiner="sum",
            optimizer=optimizer,
            eviction="lru",
            sharding=strategy,
            name="hashed",
        ),
        ks.AllToAllDenseEmbedding(
            16, DIM, combiner="sum", optimizer="adagrad", sharding="data", name="fixed"
        ),
    ]


def _model(layers):
    hashed, fixed = layers
    a = keras.Input((BAG,), dtype="int32", name="keys")
    b = keras.Input((BAG,), dtype="int32", name="ids")
    h = keras.layers.Concatenate()([hashed(a), fixed(b)])
    h = keras.layers.Dense(8, activation="relu")(h)
    model = keras.Model([a, b], keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def _data():
    rng = np.random.default_rng(3)
    n = BATCH * STEPS
    # Large int32 keys (no x64 needed), Zipf-ish so some keys stay hot.
    ranks = np.minimum(rng.zipf(1.3, size=(n, BAG)), NUM_KEYS) - 1
    keys = (ranks * 7_919_993 + 123_457).astype("int32")
    keys[::5, 0] = keys[0, 0]  # a hot key duplicated across devices
    ids = rng.integers(0, 16, size=(n, BAG)).astype("int32")
    return [keys, ids], rng.normal(size=(n, 1)).astype("float32")


def _fit(model, x, y):
    return fit_losses(model, x, y, BATCH)


def _records(layer):
    """export() records sorted by key (row placement is an internal detail)."""
    rec = layer.export()
    order = np.argsort(rec["keys"], kind="stable")
    return {name: np.asarray(value)[order] for name, value in rec.items()}


def _assert_records_close(got, want):
    assert got.keys() == want.keys()
    np.testing.assert_array_equal(got["keys"], want["keys"])
    np.testing.assert_array_equal(got["scores"], want["scores"])
    for name in got:
        np.testing.assert_allclose(
            got[name], want[name], atol=1e-5, rtol=1e-5, err_msg=name
        )


def _run(strategy, optimizer):
    x, y = _data()
    ref = _model(_layers(strategy, optimizer))
    init = [np.array(w) for w in ref.get_weights()]
    ref_losses = _fit(ref, x, y)
    ref_records = _records(ref.get_layer("hashed"))
    ref_stats = ref.get_layer("hashed").stats()
    assert ref_stats["evictions"] > 0  # the test exercises fresh rows

    layers = _layers(strategy, optimizer)
    dist = sharding.distribution(layers, devices=8)
    keras.distribution.set_distribution(dist)
    try:
        assert dist.keras_sparse_plan.strategy("hashed") == strategy
        model = _model(layers)
        model.set_weights(init)
        hashed = model.get_layer("hashed")
        routing = keras_integration.route(hashed)
        assert (routing and routing.strategy) == (
            None if strategy == "data" else strategy
        )
        losses = _fit(model, x, y)
        np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=1e-5)
        _assert_records_close(_records(hashed), ref_records)
        assert hashed.stats()["evictions"] == ref_stats["evictions"]
        shards = {
            tuple(s.data.shape) for s in hashed.embeddings.value.addressable_shards
        }
        return shards, hashed
    finally:
        keras.distribution.set_distribution(None)


def test_row_sharded_hash_embedding_matches_single_device(monkeypatch):
    resets = []
    orig = jax_sharded_reset.sharded_reset

    def spy(strategy, *args, **kwargs):
        resets.append(strategy)
        return orig(strategy, *args, **kwargs)

    monkeypatch.setattr(jax_sharded_reset, "sharded_reset", spy)
    shards, hashed = _run("row", "adagrad")
    assert resets and set(resets) == {"row"}  # fresh rows went the sharded way
    assert shards == {(hashed.capacity // 8, DIM)}
    acc = hashed.slots["accumulator"].value
    assert {tuple(s.data.shape) for s in acc.addressable_shards} == {
        (hashed.capacity // 8, DIM)
    }


def test_column_sharded_hash_embedding_matches_single_device():
    shards, hashed = _run("column", "adam")
    assert shards == {(hashed.capacity, DIM // 8)}


def test_replicated_hash_embedding_matches_single_device():
    # Its seed-generator state predates the distribution and is replicated
    # by `distribution` (a one-device variable would break the jitted step).
    shards, hashed = _run("data", "adagrad")
    assert shards == {(hashed.capacity, DIM)}


def test_planner_allows_row_and_column_for_hash_tables():
    layer = ks.DistributedHashEmbedding(DIM, capacity=1024, optimizer="adagrad")
    p = sharding.plan([layer], devices=8, pinned={layer.name: "row"})
    assert p.strategy(layer.name) == "row"
    rowwise = ks.DistributedHashEmbedding(
        DIM, capacity=1024, optimizer="rowwise_adagrad", name="rw"
    )
    with pytest.raises(ValueError, match="row-wise optimizer slots"):
        sharding.plan([rowwise], devices=8, pinned={"rw": "column"})


def test_multi_process_hash_layers_must_be_key_sharded():
    """One host key map per process cannot serve several processes: every
    strategy but "key" is refused there, naming the way out."""
    layer = ks.DistributedHashEmbedding(DIM, capacity=64, optimizer="adagrad")
    for strategy in ("row", "column", "data"):
        with pytest.raises(ValueError, match="sharding='key'"):
            keras_integration.check_hash_layer_processes(
                layer, strategy, process_count=2
            )
        keras_integration.check_hash_layer_processes(layer, strategy, process_count=1)
    keras_integration.check_hash_layer_processes(layer, "key", process_count=2)
    # Fixed-vocabulary tables are not affected.
    dense = ks.AllToAllDenseEmbedding(64, DIM)
    keras_integration.check_hash_layer_processes(dense, "row", process_count=2)


def test_eager_sharded_reset_assigns_variables():
    """Outside a trace the reset reaches the sharded variables directly."""

    def make():
        return ks.DistributedHashEmbedding(
            DIM, capacity=CAPACITY, optimizer="adagrad", sharding="row", name="e"
        )

    keys = (np.arange(2 * BATCH, dtype=np.int64) * 1_000_003).reshape(-1, 2)
    ref = make()
    ref.build()
    init = [np.array(w) for w in ref.get_weights()]
    # Keys that were seen before: the second call touches trained state.
    ref.slots["accumulator"].assign(np.full(ref.slots["accumulator"].shape, 5.0))
    init_acc = np.array(ref.slots["accumulator"].value)
    want = np.array(ref(keys, training=True))

    layer = make()
    keras.distribution.set_distribution(sharding.distribution([layer], devices=8))
    try:
        layer.build()
        layer.set_weights(init)
        layer.slots["accumulator"].assign(init_acc)
        got = np.array(layer(keys, training=True))
    finally:
        keras.distribution.set_distribution(None)
    np.testing.assert_allclose(got, want, atol=1e-6)
    for a, b in zip(layer.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # The fresh rows' slots went back to the initial value, the others not.
    acc = np.array(layer.slots["accumulator"].value)
    rows = np.asarray(layer.table.lookup(keys.reshape(-1)))
    rows = rows[rows >= 0]
    assert len(rows) and np.all(acc[rows] != 5.0) and np.sum(acc == 5.0) > 0


@pytest.mark.parametrize("strategy", ["row", "column"])
def test_reset_bytes_match_compiled_collectives(strategy):
    """exchange_bytes(reset=True) equals the compiled reset + lookup step."""
    import jax
    from jax.sharding import Mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]), ("model",))
    opt = ks.optimizers.get("adagrad", "test")
    rows, n = 64, BATCH * BAG
    spec = ("model", None) if strategy == "row" else (None, "model")

    def arg(shape, dtype, axes):
        return jax.ShapeDtypeStruct(
            shape, dtype, sharding=NamedSharding(mesh, P(*axes))
        )

    def step(table, slots, ids, valid, fresh, values, grads):
        def lookup(t, s):
            state = jax_sharded_reset.sharded_reset(
                strategy,
                mesh,
                "model",
                {"table": t, **s},
                ids,
                fresh,
                values,
                {"accumulator": 0.1},
            )
            t = state.pop("table")
            return jax_sharded_lookup.sharded_lookup_with_sparse_update(
                strategy, mesh, "model", t, state, opt, ids, valid, 0
            )

        out, vjp = jax.vjp(lookup, table, slots)
        return out, vjp(grads)

    table = arg((rows, DIM), "float32", spec)
    batch = ("model",)
    hlo = (
        jax.jit(step)
        .lower(
            table,
            {"accumulator": table},
            arg((n,), "int32", batch),
            arg((n,), "bool", batch),
            arg((n,), "bool", batch),
            arg((n, DIM), "float32", ("model", None)),
            arg((n, DIM), "float32", ("model", None)),
        )
        .compile()
        .as_text()
    )
    measured = jax_exchange_bytes.hlo_collective_bytes(hlo, 8)
    reported = jax_exchange_bytes.exchange_bytes(strategy, rows, DIM, n, 8, reset=True)
    # Flags and values, plus the ids for row (column reuses the lookup's).
    id_bytes = 4 if strategy == "row" else 0
    assert reported["reset"] == (n // 8) * (id_bytes + 1 + DIM * 4)
    assert measured["total"] == reported["total"], (measured, reported)
