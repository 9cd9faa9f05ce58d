"""JAX: the sparse update reads the touched rows from the forward's gather.

The backward takes each distinct row's values from the rows the forward
pass gathered instead of gathering them from the table again
(`keras_sparse.ops.jax.lookup.REUSE_FORWARD_ROWS`). These tests check that
it trains as the table gather does (to the ulp), on every dedup route and
size, and that the table is in fact gathered once.
"""

import keras
import numpy as np
import pytest
from keras.backend import backend

import keras_sparse as ks
from keras_sparse.layers import dedup_scratch
from keras_sparse.ops import count_buckets
from keras_sparse.ops import dense_row_updates

pytestmark = [
    pytest.mark.skipif(
        backend() != "jax", reason="the forward rows are reused on JAX only"
    ),
    pytest.mark.usefixtures("xla_route"),
]

ROWS, DIM, BATCH, BAG = 300, 4, 64, 3


def _trained(monkeypatch, reuse, collection, scratch, sized, constraint=None):
    from keras_sparse.ops.jax import lookup as jax_lookup

    monkeypatch.setattr(jax_lookup, "REUSE_FORWARD_ROWS", reuse)
    monkeypatch.setattr(dedup_scratch, "ENABLED", scratch)
    monkeypatch.setattr(count_buckets, "FORCE_SIZED", sized)
    monkeypatch.setattr(dense_row_updates, "FORCE_DENSE_ROUTE", False)
    keras.utils.set_random_seed(0)
    names = ["a", "b"]
    inputs = {n: keras.Input((BAG,), dtype="int32", name=n) for n in names}
    if collection:
        layer = ks.EmbeddingCollection(
            {n: ks.TableConfig(ROWS, DIM, combiner="sqrtn") for n in names},
            optimizer=ks.optimizers.Adagrad(0.1),
        )
        out = layer(inputs)
        parts = [out[n] for n in names]
    else:
        layer = ks.AllToAllDenseEmbedding(
            ROWS, DIM, combiner="mean", optimizer="adam", mask_zero=True,
            embeddings_constraint=constraint,
        )  # fmt: skip
        parts = [layer(inputs[n]) for n in names]
    model = keras.Model(
        inputs, keras.layers.Dense(1)(keras.layers.Concatenate()(parts))
    )
    model.compile("sgd", "mse")
    rng = np.random.default_rng(0)
    # Zipf: hot ids repeat within a batch; 0 is padding for mask_zero.
    x = {
        n: (rng.zipf(1.3, (4 * BATCH, BAG)) - 1).clip(max=ROWS - 1).astype("int32")
        for n in names
    }
    y = rng.normal(size=(4 * BATCH, 1)).astype("float32")
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    return model.get_weights()


@pytest.mark.parametrize("collection", [False, True])
@pytest.mark.parametrize("scratch,sized", [(True, True), (False, False)])
def test_training_equals_the_table_gather(monkeypatch, collection, scratch, sized):
    got = _trained(monkeypatch, True, collection, scratch, sized)
    want = _trained(monkeypatch, False, collection, scratch, sized)
    assert len(got) == len(want)
    # The same values in the same order; XLA may fuse the optimizer's math
    # differently around the other gather, hence ulps, not bits.
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


def test_a_constraint_sees_the_same_rows(monkeypatch):
    # MaxNorm(axis=0) norms over every entry of the updated rows, the
    # unused ones (row 0) included: they must hold what the gather gave.
    constraint = keras.constraints.MaxNorm(0.06)
    got = _trained(monkeypatch, True, False, True, True, constraint)
    want = _trained(monkeypatch, False, False, True, True, constraint)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)


def _table_rows_read(monkeypatch, reuse, constraint=None):
    """Rows gathered from the table in one forward + backward of the lookup."""
    import jax
    import jax.numpy as jnp

    from keras_sparse.ops.jax import lookup as jax_lookup

    monkeypatch.setattr(jax_lookup, "REUSE_FORWARD_ROWS", reuse)
    monkeypatch.setattr(dense_row_updates, "FORCE_DENSE_ROUTE", False)
    # Row-wise Adagrad: its slot ([ROWS, 1]) is told from the table by shape.
    config = jax_lookup._Config(ks.optimizers.RowWiseAdagrad(0.1), constraint)
    table = jnp.zeros((ROWS, DIM))
    slots = {"accumulator": jnp.full((ROWS, 1), 0.1)}
    ids = jnp.arange(BATCH, dtype=jnp.int32) % 7
    valid = ids != 3

    def loss(table, slots):
        rows, _, _ = jax_lookup._lookup(
            config, table, slots, ids, valid, jnp.int32(0), None
        )
        return jnp.sum(rows * rows)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(table, slots).jaxpr
    return sum(
        eqn.invars[1].aval.shape[0]
        for eqn in _equations(jaxpr)
        if eqn.primitive.name == "gather" and eqn.invars[0].aval.shape == (ROWS, DIM)
    )


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from _equations(getattr(inner, "jaxpr", inner))


def test_the_backward_reads_no_table_row_again(monkeypatch):
    # The forward reads BATCH rows. The backward, without reuse, reads the
    # (padded) distinct rows again, BATCH entries; with it none, or under a
    # constraint row 0 once (the unused entries' value).
    assert _table_rows_read(monkeypatch, False) == 2 * BATCH
    assert _table_rows_read(monkeypatch, True) == BATCH
    constraint = keras.constraints.MaxNorm(0.06)
    assert _table_rows_read(monkeypatch, True, constraint) == BATCH + 1


def test_large_tables_only_and_not_under_a_distribution():
    import jax.numpy as jnp

    from keras_sparse.ops.jax import lookup as jax_lookup

    small = jnp.zeros((1000, 16))
    large = jnp.zeros((jax_lookup.FORWARD_ROWS_MIN_BYTES // 64, 16))
    config = jax_lookup._Config(ks.optimizers.Adagrad(0.1), None)
    assert jax_lookup.REUSE_FORWARD_ROWS is None  # the default: by size
    assert not jax_lookup._reuses_forward_rows(small, config)
    assert jax_lookup._reuses_forward_rows(large, config)
    # Under a distribution the rows are split by batch; the table read
    # needs no collective.
    import jax

    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices()[:1])
    )
    try:
        assert not jax_lookup._reuses_forward_rows(large, config)
    finally:
        keras.distribution.set_distribution(None)
