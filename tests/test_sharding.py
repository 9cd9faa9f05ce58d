"""Sharded embeddings on 8 CPU devices match single-device training (JAX)."""

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse import sharding
from keras_sparse.ops.jax import lookup as jax_lookup
from keras_sparse.ops.lookup_batch import LookupBatch
from keras_sparse.ops.lookup_batch import TableState
from keras_sparse.sharding import jax_exchange_bytes
from keras_sparse.sharding import jax_sharded_lookup

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="sharding is implemented for JAX"
)

ROWS, DIM, BAG, BATCH, STEPS = 64, 8, 4, 32, 20


def _layers(strategy, optimizer, combiner="sum"):
    return [
        ks.AllToAllDenseEmbedding(
            ROWS,
            DIM,
            combiner=combiner,
            optimizer=optimizer,
            sharding=strategy,
            name="big",
        ),
        ks.AllToAllDenseEmbedding(
            16,
            DIM,
            combiner=combiner,
            optimizer=optimizer,
            sharding="data",
            name="small",
        ),
    ]


def _model(layers):
    a = keras.Input((BAG,), dtype="int32", name="a")
    b = keras.Input((BAG,), dtype="int32", name="b")
    h = keras.layers.Concatenate()([layers[0](a), layers[1](b)])
    h = keras.layers.Dense(8, activation="relu")(h)
    out = keras.layers.Dense(1)(h)
    model = keras.Model([a, b], out)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    n = BATCH * STEPS
    a = rng.integers(0, ROWS, size=(n, BAG)).astype("int32")
    a[:, 0] = 3  # a hot row: duplicates across devices every step
    b = rng.integers(0, 16, size=(n, BAG)).astype("int32")
    y = rng.normal(size=(n, 1)).astype("float32")
    return [a, b], y


class _Losses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def _train(model, x, y):
    rec = _Losses()
    model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[rec]
    )
    return rec.losses


def _run(strategy, optimizer):
    x, y = _data()
    ref = _model(_layers(strategy, optimizer))
    init = [np.array(w) for w in ref.get_weights()]
    ref_losses = _train(ref, x, y)
    probe = [x[0][:BATCH], x[1][:BATCH]]
    ref_pred = ref.predict(probe, batch_size=BATCH, verbose=0)
    ref_eval = ref.evaluate(x, y, batch_size=BATCH, verbose=0)
    ref_tables = {
        n: np.array(ref.get_layer(n).embeddings.value) for n in ("big", "small")
    }

    layers = _layers(strategy, optimizer)
    dist = sharding.distribution(layers, devices=8)
    keras.distribution.set_distribution(dist)
    try:
        routing = sharding.keras_integration.route(layers[0])
        if strategy in ("row", "column"):
            assert routing is not None and routing.strategy == strategy
        else:
            assert routing is None  # data: XLA partitions the 1-device primitive
        model = _model(layers)
        model.set_weights(init)
        losses = _train(model, x, y)
        tables = {n: model.get_layer(n).embeddings for n in ("big", "small")}
        np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=1e-5)
        for name, var in tables.items():
            np.testing.assert_allclose(
                np.array(var.value), ref_tables[name], atol=1e-5, rtol=1e-5
            )
        # Inference under the distribution (no update) agrees too.
        pred = model.predict(probe, batch_size=BATCH, verbose=0)
        np.testing.assert_allclose(pred, ref_pred, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(
            model.evaluate(x, y, batch_size=BATCH, verbose=0),
            ref_eval,
            atol=1e-5,
            rtol=1e-5,
        )
        return dist, model
    finally:
        keras.distribution.set_distribution(None)


class _Value:
    def __init__(self, value):
        self.value = value


def _shard_shapes(variable):
    return {tuple(s.data.shape) for s in variable.value.addressable_shards}


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad", "adam", None])
def test_row_matches_single_device(optimizer, monkeypatch):
    calls = []
    for fn in ("sharded_lookup_with_sparse_update", "sharded_gather"):
        orig = getattr(jax_sharded_lookup, fn)

        def spy(strategy, *args, _orig=orig, **kwargs):
            calls.append(strategy)
            return _orig(strategy, *args, **kwargs)

        monkeypatch.setattr(jax_sharded_lookup, fn, spy)
    dist, model = _run("row", optimizer)
    assert calls and set(calls) == {"row"}  # the sharded primitive really ran
    big = model.get_layer("big")
    assert len(big.embeddings.value.addressable_shards) == 8
    assert _shard_shapes(big.embeddings) == {(ROWS // 8, DIM)}
    for slot in big.slots.values():
        assert _shard_shapes(slot) == {(ROWS // 8, slot.shape[1])}
    assert _shard_shapes(model.get_layer("small").embeddings) == {(16, DIM)}
    assert dist.keras_sparse_plan.strategy("big") == "row"


def test_column_matches_single_device():
    _, model = _run("column", "adagrad")
    big = model.get_layer("big")
    assert _shard_shapes(big.embeddings) == {(ROWS, DIM // 8)}
    assert _shard_shapes(big.slots["accumulator"]) == {(ROWS, DIM // 8)}


def test_data_matches_single_device():
    _, model = _run("data", "adam")
    assert _shard_shapes(model.get_layer("big").embeddings) == {(ROWS, DIM)}


def test_row_exchange_below_table_all_gather():
    ids = BATCH * BAG
    got = jax_exchange_bytes.exchange_bytes("row", ROWS, DIM, ids, 8)
    assert got["total"] == 8 * (ids // 8) * (4 + 2 * DIM * 4)
    big = 10_000_000
    got = sharding.exchange_bytes("row", big, DIM, ids, 8)
    assert got["total"] < jax_exchange_bytes.table_all_gather_bytes(big, DIM, 8)


def test_update_keeps_n_rows_under_a_distribution():
    import jax

    from keras_sparse.ops import count_buckets

    assert count_buckets.sized_by_count(under_distribution=False)  # CPU
    assert not count_buckets.sized_by_count(n=count_buckets.MIN_SIZED_POSITIONS - 1)
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices()[:8])
    )
    try:
        assert not count_buckets.sized_by_count(under_distribution=False)
        assert count_buckets.sized_by_count()  # fresh-row draws keep sizing
    finally:
        keras.distribution.set_distribution(previous)


def test_no_distribution_means_no_routing():
    layer = ks.AllToAllDenseEmbedding(ROWS, DIM, sharding="row")
    assert sharding.keras_integration.route(layer) is None


@pytest.mark.parametrize(
    "strategy,spec",
    [("row", ("model", None)), ("column", (None, "model")), ("data", (None, None))],
)
def test_reported_bytes_match_compiled_collectives(strategy, spec, monkeypatch):
    """exchange_bytes() equals what the compiled program puts into collectives."""
    import jax

    from keras_sparse.ops import count_buckets
    from keras_sparse.ops import dense_row_updates

    # No keras.distribution is set here; under one (as in real use, see
    # test_update_keeps_n_rows_under_a_distribution) the update is not sized,
    # and it never updates the whole table (`uses_dense_route`).
    monkeypatch.setattr(count_buckets, "FORCE_SIZED", False)
    monkeypatch.setattr(dense_row_updates, "FORCE_DENSE_ROUTE", False)
    # Nor does it read the touched rows from the forward's (batch-split)
    # rows, which would take an all-reduce (`jax_lookup._reuses_forward_rows`).
    monkeypatch.setattr(jax_lookup, "REUSE_FORWARD_ROWS", False)
    from jax.sharding import Mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]), ("model",))
    opt = ks.optimizers.get("adagrad", "test")
    n = BATCH * BAG

    def arg(shape, dtype, axes):
        return jax.ShapeDtypeStruct(
            shape, dtype, sharding=NamedSharding(mesh, P(*axes))
        )

    table = arg((ROWS, DIM), "float32", spec)

    def lookup(t, s, ids, valid):
        if strategy == "data":  # the single-device primitive, XLA-partitioned
            state = TableState(
                _Value(t), {k: _Value(v) for k, v in s.items()}, None, opt
            )
            return jax_lookup.lookup(state, LookupBatch(ids, valid, 0))
        return jax_sharded_lookup.sharded_lookup_with_sparse_update(
            strategy, mesh, "model", t, s, opt, ids, valid, 0
        )

    def step(table, slots, ids, valid, grads):
        out, vjp = jax.vjp(
            lambda t, s: lookup(t, s, ids, valid),
            table,
            slots,
        )
        return out, vjp(grads)

    hlo = (
        jax.jit(step)
        .lower(
            table,
            {"accumulator": table},
            arg((n,), "int32", ("model",)),
            arg((n,), "bool", ("model",)),
            arg((n, DIM), "float32", ("model", None)),
        )
        .compile()
        .as_text()
    )
    measured = jax_exchange_bytes.hlo_collective_bytes(hlo, 8)
    reported = jax_exchange_bytes.exchange_bytes(strategy, ROWS, DIM, n, 8)
    assert measured["total"] == reported["total"], (measured, reported)


def test_auto_plan_lays_out_variables():
    layers = _layers("auto", "adagrad")
    big_bytes = ROWS * DIM * 2 * 4
    dist = sharding.distribution(
        layers,
        devices=8,
        memory_per_device=big_bytes // 2,
        batch_size=BATCH,
        ids_per_sample=BAG,
    )
    plan = dist.keras_sparse_plan
    assert plan.strategy("big") == "row"  # does not fit replicated
    assert plan.strategy("small") == "data"  # pinned by the layer
    keras.distribution.set_distribution(dist)
    try:
        model = _model(layers)
        big = model.get_layer("big")
        assert _shard_shapes(big.embeddings) == {(ROWS // 8, DIM)}
        assert _shard_shapes(big.slots["accumulator"]) == {(ROWS // 8, DIM)}
        assert sharding.keras_integration.route(big).strategy == "row"
    finally:
        keras.distribution.set_distribution(None)


def test_table_strategy_needs_an_embedding_collection():
    # "table" runs for the tables of an EmbeddingCollection
    # (tests/test_sharding_table.py); a standalone layer pinned to it is
    # refused by the planner, and a hand-made plan placing it by distribution.
    layers = _layers("table", "adagrad")
    with pytest.raises(ValueError, match="'big'.*EmbeddingCollection"):
        sharding.distribution(layers, devices=8)
    spec = sharding.TableSpec.from_layer(layers[0])
    plan = sharding.Plan(
        [sharding.TablePlan(spec, "table", (0,), 0, 0, "by hand")], 8, None, []
    )
    with pytest.raises(ValueError, match="'big'.*EmbeddingCollection"):
        sharding.distribution(layers[:1], devices=8, plan=plan)
