"""Table-wise (and mixed) sharding of an EmbeddingCollection on 8 CPU devices
matches single-device training; checkpoints reshard (JAX)."""

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse import sharding
from keras_sparse.sharding import jax_sharded_lookup
from tests.helpers import fit_losses

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="sharding is implemented for JAX"
)

DIM, BAG, BATCH, STEPS = 8, 2, 32, 20
# Uneven sizes, none a multiple of 8: the planner packs them onto devices.
ROWS = {"t0": 61, "t1": 23, "t2": 40, "t3": 9, "t4": 35, "t5": 50, "t6": 17}


def _collection(pins=None, optimizer="adagrad", sharding_default="table"):
    pins = pins or {}
    return ks.EmbeddingCollection(
        {
            n: ks.TableConfig(r, DIM, combiner="sum", sharding=pins.get(n, "auto"))
            for n, r in ROWS.items()
        },
        optimizer=optimizer,
        sharding=sharding_default,
        name="features",
    )


def _model(coll):
    inputs = {n: keras.Input((BAG,), dtype="int32", name=n) for n in ROWS}
    out = coll(inputs)
    h = keras.layers.Concatenate()([out[n] for n in ROWS])
    h = keras.layers.Dense(8, activation="relu", name="hidden")(h)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(h))
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def _data(seed=0):
    rng = np.random.default_rng(seed)
    n = BATCH * STEPS
    x = {k: rng.integers(0, r, size=(n, BAG)).astype("int32") for k, r in ROWS.items()}
    x["t0"][:, 0] = 3  # a hot row: duplicates across devices every step
    return x, rng.normal(size=(n, 1)).astype("float32")


def _fit(model, x, y):
    return fit_losses(model, x, y, BATCH)


def _table_state(coll):
    """Per-table saved state (tables, slots, step counter) as a dict."""
    store = {}
    coll.save_own_variables(store)
    return {k: np.array(v) for k, v in store.items()}


def _dense_state(model):
    out = {v.path: np.array(v.value) for v in model.optimizer.variables}
    for name in ("hidden", "head"):
        out.update({v.path: np.array(v.value) for v in model.get_layer(name).variables})
    return out


def _assert_same(got, want, exact=True):
    assert got.keys() == want.keys()
    for key in want:
        if exact:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        else:
            np.testing.assert_allclose(
                got[key], want[key], atol=1e-5, rtol=1e-5, err_msg=key
            )


def _train_single(x, y, **kwargs):
    coll = _collection(**kwargs)
    model = _model(coll)
    init = {n: coll.get_table(n) for n in ROWS}
    dense = {n: model.get_layer(n).get_weights() for n in ("hidden", "head")}
    losses = _fit(model, x, y)
    return init, dense, losses, _table_state(coll)


def _train_sharded(x, y, init, dense, **kwargs):
    coll = _collection(**kwargs)
    dist = sharding.distribution([coll], devices=8)
    keras.distribution.set_distribution(dist)
    model = _model(coll)
    for n, value in init.items():
        coll.set_table(n, value)
    for n, w in dense.items():
        model.get_layer(n).set_weights(w)
    return dist, coll, model, _fit(model, x, y)


def _rows_per_device(plan):
    per = [0] * plan.num_devices
    for t in plan:
        if t.strategy == "table":
            per[t.devices[0]] += t.spec.rows
    return per


def test_table_wise_matches_single_device(monkeypatch):
    x, y = _data()
    init, dense, ref_losses, ref_state = _train_single(x, y)
    calls = []
    orig = jax_sharded_lookup.sharded_lookup_with_sparse_update

    def spy(strategy, *args, **kwargs):
        calls.append((strategy, kwargs.get("slack")))
        return orig(strategy, *args, **kwargs)

    monkeypatch.setattr(jax_sharded_lookup, "sharded_lookup_with_sparse_update", spy)
    try:
        dist, coll, model, losses = _train_sharded(x, y, init, dense)
        plan = dist.keras_sparse_plan
        assert {t.strategy for t in plan} == {"table"}
        assert {t.name for t in plan} == {f"features/{n}" for n in ROWS}
        # The row primitive, full-size buffers, one lookup per stack.
        assert calls and set(calls) == {("row", None)}
        np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=1e-5)
        _assert_same(_table_state(coll), ref_state, exact=False)

        # Per-device memory: one stack [8 * B, DIM]; each device holds B rows,
        # B = the planner's busiest device, below the total row count.
        per_device = _rows_per_device(plan)
        block = max(per_device)
        assert block < sum(ROWS.values())
        assert len(coll.stacks) == 1 and coll.stacks[0].block_rows == block
        for var in coll.stack_variables(coll.stacks[0].name):
            shards = var.value.addressable_shards
            assert len(shards) == 8
            assert {tuple(s.data.shape) for s in shards} == {(block, var.shape[1])}
        # Each table sits whole in its planned device's block.
        stack = coll.stacks[0]
        for t in plan:
            start = stack.offsets[t.spec.collection_table]
            assert start // block == t.devices[0]
            assert (start + t.spec.rows - 1) // block == t.devices[0]
        # Inference under the distribution leaves the tables alone.
        before = _table_state(coll)
        model.predict({n: v[:BATCH] for n, v in x.items()}, verbose=0)
        _assert_same(_table_state(coll), before)
    finally:
        keras.distribution.set_distribution(None)


def test_mixed_plan_matches_single_device():
    pins = {"t0": "row", "t2": "column", "t3": "data", "t5": "row"}
    x, y = _data(2)
    init, dense, ref_losses, ref_state = _train_single(x, y, pins=pins)
    try:
        dist, coll, _, losses = _train_sharded(x, y, init, dense, pins=pins)
        strategies = {
            t.spec.collection_table: t.strategy for t in dist.keras_sparse_plan
        }
        assert strategies == {n: pins.get(n, "table") for n in ROWS}
        assert {s.strategy: s.tables for s in coll.stacks} == {
            "row": ("t0", "t5"),
            "table": ("t1", "t4", "t6"),
            "column": ("t2",),
            "data": ("t3",),
        }
        np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=1e-5)
        _assert_same(_table_state(coll), ref_state, exact=False)
        row = next(s for s in coll.stacks if s.strategy == "row")
        assert row.rows == 112  # 61 + 50 = 111 rows, padded to 8 blocks of 14
        shard_shapes = {
            tuple(s.data.shape)
            for s in coll.stack_variables(row.name)[0].value.addressable_shards
        }
        assert shard_shapes == {(14, DIM)}
    finally:
        keras.distribution.set_distribution(None)


def test_reshard_round_trip(tmp_path):
    import jax

    x, y = _data()
    coll = _collection()
    keras.distribution.set_distribution(sharding.distribution([coll], devices=8))
    try:
        model = _model(coll)
        _fit(model, x, y)
        want = _table_state(coll)
        want_dense = _dense_state(model)
        assert int(want["sparse_iterations"]) == STEPS
        path8 = str(tmp_path / "m8.keras")
        model.save(path8)
        x2, y2 = _data(1)
        cont8 = _fit(model, x2, y2)  # the continuation to match at the end
    finally:
        keras.distribution.set_distribution(None)

    def check(model, devices):
        got = model.get_layer("features")
        _assert_same(_table_state(got), want)
        _assert_same(_dense_state(model), want_dense)
        if devices > 1:
            var = got.stack_variables(got.stacks[0].name)[0].value
            assert len(var.sharding.device_set) == devices

    try:
        m4, dist4 = sharding.load_model(path8, devices=jax.devices()[:4])
        assert {t.strategy for t in dist4.keras_sparse_plan} == {"table"}
        assert m4.get_layer("features").stacks[0].rows % 4 == 0
        check(m4, 4)
        path4 = str(tmp_path / "m4.keras")
        m4.save(path4)
    finally:
        keras.distribution.set_distribution(None)

    m1, dist1 = sharding.load_model(path4, devices=1)
    assert dist1 is None
    assert sum(s.rows for s in m1.get_layer("features").stacks) == sum(ROWS.values())
    check(m1, 1)
    path1 = str(tmp_path / "m1.keras")
    m1.save(path1)

    try:
        m8, _ = sharding.load_model(path1, devices=8)
        check(m8, 8)
        np.testing.assert_allclose(_fit(m8, x2, y2), cont8, atol=1e-5, rtol=1e-5)
    finally:
        keras.distribution.set_distribution(None)


def test_plan_lists_collection_tables_and_refuses_what_cannot_run():
    coll = _collection(sharding_default="auto")
    text = str(ks.plan([coll], devices=8, strategies=("table",)))
    for n in ROWS:
        assert f"features/{n}" in text
    # A standalone layer cannot be placed table-wise: the error names the
    # table and points to EmbeddingCollection.
    alone = ks.AllToAllDenseEmbedding(
        10, DIM, optimizer="sgd", sharding="table", name="standalone"
    )
    with pytest.raises(ValueError, match=r"standalone.*Collection"):
        ks.plan([alone], devices=8)
    auto = ks.AllToAllDenseEmbedding(10, DIM, optimizer="sgd", name="alone")
    plan = ks.plan([auto], devices=8, strategies=("table", "row"))
    assert plan.strategy("alone") == "row"
    assert "EmbeddingCollection" in plan["alone"].reason
    # Sharded collection tables need a sparse optimizer.
    dense = _collection(optimizer=None)
    with pytest.raises(ValueError, match=r"features/t\d.*sparse optimizer"):
        sharding.distribution([dense], devices=8)
    # A built collection cannot be re-stacked in place.
    built = _collection()
    built.build()
    with pytest.raises(ValueError, match=r"'features'.*re-stacked"):
        sharding.distribution([built], devices=8)


def test_a_built_collection_goes_replicated_in_place():
    """A collection built without a distribution (one stack per table on a
    JAX CPU step) is laid out in place, replicated, by an all-"data"
    distribution, as a stacked one was."""
    coll = _collection(sharding_default="data")
    coll.build()
    before = [s.tables for s in coll.stacks]
    sharding.distribution([coll], devices=8)
    assert [s.tables for s in coll.stacks] == before
    for stack in coll.stacks:
        for variable in coll.stack_variables(stack.name):
            assert len(variable.value.sharding.device_set) == 8
            assert variable.value.sharding.is_fully_replicated
