"""Compact row exchange buffers: fewer bytes, same result, loud overflow (JAX)."""

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="sharding is implemented for JAX"
)

ROWS, DIM, D, N = 64, 8, 8, 256  # N ids in the global batch: 32 per device


def _setup():
    import jax
    from jax.sharding import Mesh

    import keras_sparse as ks

    mesh = Mesh(np.array(jax.devices()[:D]), ("model",))
    return jax, mesh, ks.optimizers.get("adagrad", "test")


def _step_fn(jax, mesh, opt, slack, host_slots=False):
    from keras_sparse.sharding import jax_sharded_lookup as jsl

    def step(table, slots, ids, valid, grads, *given):
        options = {"slack": slack, "exchange_slot": given[0] if host_slots else None}
        out, vjp = jax.vjp(
            lambda t, s: jsl.sharded_lookup_with_sparse_update(
                "row", mesh, "model", t, s, opt, ids, valid, 0, **options
            ),
            table,
            slots,
        )
        return out, vjp(grads)

    return jax.jit(step)


def _args(jax, mesh, ids):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(0)
    row = NamedSharding(mesh, P("model", None))
    table = jax.device_put(rng.normal(size=(ROWS, DIM)).astype("float32"), row)
    acc = jax.device_put(np.full((ROWS, DIM), 0.1, "float32"), row)
    valid = ids >= 0
    valid[::7] = False  # some padding positions
    grads = rng.normal(size=(len(ids), DIM)).astype("float32")
    put = lambda a, *s: jax.device_put(a, NamedSharding(mesh, P("model", *s)))  # noqa: E731
    return (
        table,
        {"accumulator": acc},
        put(ids.astype("int32")),
        put(valid),
        put(grads, None),
    )


def test_compact_matches_full_buffers():
    jax, mesh, opt = _setup()
    ids = np.random.default_rng(1).integers(0, ROWS, N)
    ids[::5] = 9  # a hot id, as in real data
    args = _args(jax, mesh, ids)
    full = _step_fn(jax, mesh, opt, None)(*args)
    compact = _step_fn(jax, mesh, opt, 4.0)(*args)  # 16 of 32 slots
    rows, *state = jax.tree.leaves(compact)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(full[0]))
    # Compact buffers sum a device's repeats before sending: same terms,
    # grouped by device, so the last bits may differ.
    for a, b in zip(jax.tree.leaves(full[1]), state):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)


def _python_slots(rows, devices, shard_rows, dedup):
    """Reference numbering: per device, count earlier ids per owner, or
    (``dedup``) smaller distinct ids per owner."""
    out = []
    for local in np.asarray(rows).reshape(devices, -1):
        seen = {}
        for r in local.tolist():
            if r < 0:
                out.append(0)
                continue
            owner = r // shard_rows
            if dedup:
                mine = {v for v in local.tolist() if v // shard_rows == owner}
                out.append(sum(v < r for v in mine))
                continue
            out.append(seen.get(owner, 0))
            seen[owner] = seen.get(owner, 0) + 1
    return np.array(out)


@pytest.mark.backend_independent
@pytest.mark.parametrize("dedup", [True, False])
def test_host_exchange_slots_match_a_python_reference(dedup):
    from keras_sparse.sharding.exchange_buckets import ExchangeOverflowError
    from keras_sparse.sharding.exchange_buckets import bucket_fill
    from keras_sparse.sharding.exchange_buckets import exchange_slots

    rng = np.random.default_rng(5)
    rows = rng.integers(-1, ROWS, (16, 16))  # 256 ids, 32 per device
    rows[:, 3] = 9  # a hot row
    want = _python_slots(rows, D, ROWS // D, dedup)
    got = exchange_slots(rows, D, ROWS // D, capacity=32, dedup=dedup)
    assert got.shape == rows.shape and got.dtype == np.int32
    np.testing.assert_array_equal(got.reshape(-1), want)
    worst = int(want.max()) + 1
    fill = bucket_fill(rows, D, ROWS // D, dedup)
    assert fill.shape == (D, D) and fill.max() == worst
    exchange_slots(rows, D, ROWS // D, capacity=worst, dedup=dedup)  # just fits
    with pytest.raises(ExchangeOverflowError, match="'emb'.*device \\d+ had"):
        exchange_slots(rows, D, ROWS // D, worst - 1, "layer 'emb'", dedup)
    with pytest.raises(ValueError, match="split evenly over 8 devices"):
        exchange_slots(rows[:, :3].reshape(-1)[:45], D, ROWS // D, 32, dedup=dedup)


def test_step_takes_host_slots_without_the_in_step_check():
    from keras_sparse.sharding import jax_exchange_bytes as jeb
    from keras_sparse.sharding import jax_row_buffers as jrb
    from keras_sparse.sharding.exchange_buckets import exchange_slots

    jax, mesh, opt = _setup()
    ids = np.random.default_rng(1).integers(0, ROWS, N)
    ids[::5] = 9
    args = _args(jax, mesh, ids)
    rows = np.where(np.asarray(args[3]), ids, -1)
    slots = exchange_slots(rows, D, ROWS // D, jrb.row_capacity(N // D, D, 4.0))
    put = jax.device_put(
        slots, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model"))
    )
    in_step = _step_fn(jax, mesh, opt, 4.0)(*args)
    given = _step_fn(jax, mesh, opt, 4.0, host_slots=True)
    for a, b in zip(jax.tree.leaves(in_step), jax.tree.leaves(given(*args, put))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    hlo = given.lower(*args, put).compile().as_text()
    measured = jeb.hlo_collective_bytes(hlo, D)
    assert "all-reduce" not in measured  # no overflow pmax in the step
    assert "callback" not in hlo.lower()  # (the in-step check has one)
    assert measured["total"] == D * 16 * (4 + 2 * DIM * 4)


def test_overflow_raises_instead_of_dropping():
    jax, mesh, opt = _setup()
    ids = np.random.default_rng(2).integers(0, ROWS // D, N)  # all on shard 0
    step = _step_fn(jax, mesh, opt, 1.0)  # 4 slots < 8 distinct ids per device
    with pytest.raises(Exception, match="exchange slots per destination"):
        out = step(*_args(jax, mesh, ids))
        jax.block_until_ready(out)


@pytest.mark.parametrize("slack", [None, 1.5, 4.0])
def test_reported_bytes_match_compiled_collectives(slack):
    from keras_sparse.sharding import jax_exchange_bytes as jeb
    from keras_sparse.sharding import jax_row_buffers as jrb

    jax, mesh, opt = _setup()
    args = _args(jax, mesh, np.zeros(N, "int64"))
    hlo = _step_fn(jax, mesh, opt, slack).lower(*args).compile().as_text()
    measured = jeb.hlo_collective_bytes(hlo, D)
    reported = jeb.exchange_bytes("row", ROWS, DIM, N, D, slack=slack)
    assert measured["total"] == reported["total"], (measured, reported)
    c = jrb.row_capacity(N // D, D, slack)
    assert c == {None: 32, 1.5: 6, 4.0: 16}[slack]
    check = 4 if c < N // D else 0  # the overflow check's pmax
    assert reported["total"] == D * c * (4 + 2 * DIM * 4) + check


def test_fit_with_slack_and_overflow_error():
    import keras_sparse as ks
    from keras_sparse import sharding

    def layers():
        return [
            ks.AllToAllDenseEmbedding(
                ROWS, DIM, combiner="sum", optimizer="adagrad", sharding="row"
            )
        ]

    def model(layer):
        x = keras.Input((4,), dtype="int32")
        m = keras.Model(x, keras.layers.Dense(1)(layer(x)))
        m.compile("sgd", "mse")
        return m

    y = np.zeros((64, 1), "float32")
    # 32 ids per device, 4 per owner: the 4 slots of slack 1 fit them.
    j = np.arange(32)
    ok = np.tile(j % D * (ROWS // D) + j // D, D).reshape(64, 4)
    ref = model(layers()[0])
    init = [np.array(w) for w in ref.get_weights()]
    ref_loss = ref.fit(ok, y, batch_size=64, shuffle=False, verbose=0)
    ref_loss = ref_loss.history["loss"]
    layer = layers()[0]
    dist = sharding.distribution([layer], devices=D, row_exchange_slack=1.0)
    keras.distribution.set_distribution(dist)
    try:
        m = model(layer)
        m.set_weights(init)
        loss = m.fit(ok, y, batch_size=64, shuffle=False, verbose=0)
        loss = loss.history["loss"]
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            np.array(layer.embeddings.value),
            np.array(ref.layers[1].embeddings.value),
            rtol=1e-5,
            atol=1e-6,
        )
        # Every device's ids: the 8 distinct rows of shard 0.
        skewed = (np.arange(64 * 4).reshape(64, 4) % (ROWS // D)).astype("int32")
        with pytest.raises(Exception, match="row_exchange_slack"):
            # Raised when the step's outputs are read (here: the last loss).
            hist = m.fit(skewed, y, batch_size=64, verbose=0)
            float(hist.history["loss"][-1])
    finally:
        keras.distribution.set_distribution(None)


def test_repeated_ids_fit_buffers_sized_on_distinct_ids():
    # Every device's 32 ids lie in shard 0's 8 rows: 8 distinct ids per
    # device fit the 8 slots of slack 2; one slot per position overflowed.
    from keras_sparse.ops.jax import lookup as single
    from keras_sparse.sharding import jax_exchange_bytes as jeb
    from keras_sparse.sharding.exchange_buckets import bucket_fill

    jax, mesh, opt = _setup()
    ids = np.random.default_rng(2).integers(0, ROWS // D, N)
    args = _args(jax, mesh, ids)
    step = _step_fn(jax, mesh, opt, 2.0).lower(*args).compile()
    rows, (table, slots) = step(*args)
    table0, slots0, _, valid, grads = (np.asarray(a) for a in jax.tree.leaves(args))
    want = np.where(valid[:, None], table0[ids], 0)
    np.testing.assert_array_equal(np.asarray(rows), want)

    def one_device(t, s):  # the unsharded primitive: global-order sums
        cfg = single._Config(opt, None)
        return single._lookup(cfg, t, s, ids, valid, 0, None)[0]

    _, vjp = jax.vjp(one_device, table0, {"accumulator": slots0})
    ref_table, ref_slots = vjp(grads)
    assert not np.allclose(ref_table, table0)  # rows were updated
    np.testing.assert_allclose(table, ref_table, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        slots["accumulator"], ref_slots["accumulator"], rtol=1e-6, atol=1e-6
    )
    measured = jeb.hlo_collective_bytes(step.as_text(), D)
    assert measured["total"] == D * 8 * (4 + 2 * DIM * 4) + 4
    fill = bucket_fill(np.where(valid, ids, -1), D, ROWS // D)
    assert fill.max() == 8 and fill[:, 1:].sum() == 0
    reported = jeb.exchange_bytes("row", ROWS, DIM, N, D, capacity=fill.max())
    assert reported["total"] == measured["total"]


@pytest.mark.parametrize("n", [32, 1024])  # pairwise comparison, packed sort
def test_in_step_distinct_slots_match_the_host_packing(n):
    import jax.numpy as jnp

    from keras_sparse.sharding import jax_row_buffers as jrb
    from keras_sparse.sharding.exchange_buckets import bucket_fill
    from keras_sparse.sharding.exchange_buckets import exchange_slots

    rng = np.random.default_rng(n)
    rows = rng.integers(-1, ROWS, n)
    rows[::3] = 9  # repeats
    valid = rows >= 0
    want = exchange_slots(np.tile(rows, D), D, ROWS // D, n)[:n]
    slot, fill = jrb.distinct_slots(jnp.asarray(rows), jnp.asarray(valid), D, 8)
    np.testing.assert_array_equal(np.asarray(slot), want)
    np.testing.assert_array_equal(
        np.asarray(fill), bucket_fill(np.tile(rows, D), D, ROWS // D)[0]
    )
