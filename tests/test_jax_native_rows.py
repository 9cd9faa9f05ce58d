"""The compiled JAX row update and gather (keras_sparse.ops.jax.native_rows):
equal to a NumPy float32 model of SGD, Adagrad, Adam and RowWiseAdagrad to
the bit, in place on donated state, safe on bad ids, used only where it
applies, close to the XLA route, and a clean fallback when it cannot be
built."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from hypothesis import settings

from tests import optimizer_models as models
from tests.optimizer_models import F

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="the JAX custom calls"
)


def _module():
    """``jax_native_rows``; skips the test where it cannot be built."""
    from keras_sparse.ops.jax import native_rows as jax_native_rows

    if jax_native_rows.library() is None:
        pytest.skip(f"JAX custom calls unavailable: {jax_native_rows.status()}")
    return jax_native_rows


def _apply(optimizer, table, slots, ids, valid, grads, it, constraint=None):
    """``(new state as NumPy, whether the custom call applies)``."""
    import jax
    import jax.numpy as jnp

    native = _module()
    fused = native.fused_rule(optimizer, constraint, jnp.asarray(table))
    if fused is None:
        return None, False
    state = {
        "table": jnp.asarray(table),
        **{k: jnp.asarray(v) for k, v in slots.items()},
    }
    step = jax.jit(
        lambda s, i, v, g, t: native.fused_update(s, optimizer, i, v, g, t, *fused)
    )
    out = step(state, ids.astype(np.int32), valid, grads, jnp.int32(it))
    return {k: np.asarray(v) for k, v in out.items()}, True


@pytest.mark.parametrize("name", models.NAMES)
@settings(max_examples=15, deadline=None)
@models.given_updates()
def test_the_call_equals_numpy_to_the_bit(name, seed, n, rows, dim, it):
    optimizer = models.optimizer(name)
    rng = np.random.default_rng(seed)
    table, slots = models.random_state(optimizer, rng, rows, dim)
    ids, valid, grads = models.random_batch(rng, rows, n, dim)
    got, fused = _apply(optimizer, table, slots, ids, valid, grads, it)
    assert fused
    want = models.numpy_update(name, optimizer, table, slots, ids, valid, grads, it)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.parametrize("name", ["rowwise_adagrad", "ftrl_power"])
def test_several_steps_with_duplicates(name):
    def apply(*args):
        state, fused = _apply(*args)
        assert fused
        return state

    models.check_several_steps(apply, name)


def test_the_gather_equals_numpy_with_zeros_where_not_valid(monkeypatch):
    import jax

    native = _module()
    monkeypatch.setattr(native, "PREFETCH_GATHER", True)  # small tables too
    rng = np.random.default_rng(1)
    table = rng.normal(size=(500, 7)).astype(F)
    for n in (0, 1, 15, 16, 17, 300):
        ids = rng.integers(0, 500, n).astype(np.int32)
        valid = rng.random(n) >= 0.3
        ids[~valid] = -5  # never read where not valid
        got = jax.jit(native.gather_rows)(table, ids, valid)
        want = np.where(valid[:, None], table[np.where(valid, ids, 0)], 0)
        np.testing.assert_array_equal(np.asarray(got), want)


def test_donated_state_is_updated_in_its_own_buffer():
    import jax
    import jax.numpy as jnp

    from keras_sparse import optimizers

    native = _module()
    optimizer = optimizers.Adagrad(0.1)
    fused = native.fused_rule(optimizer, None, jnp.zeros((4, 2)))
    state = {"table": jnp.ones((1000, 8)), "accumulator": jnp.full((1000, 8), 0.1)}
    before = {k: v.unsafe_buffer_pointer() for k, v in state.items()}
    step = jax.jit(
        lambda s, i, v, g: native.fused_update(s, optimizer, i, v, g, 0, *fused),
        donate_argnums=0,
    )
    ids = np.array([3, 9, 3], np.int32)
    out = step(state, ids, np.ones(3, bool), np.ones((3, 8), F))
    assert {k: v.unsafe_buffer_pointer() for k, v in out.items()} == before
    table = np.asarray(out["table"])
    assert (table[[3, 9]] < 1).all() and (np.delete(table, [3, 9], 0) == 1).all()


def test_an_id_outside_the_rows_raises_and_changes_nothing(monkeypatch):
    import jax
    import jax.numpy as jnp

    from keras_sparse import optimizers

    native = _module()
    monkeypatch.setattr(native, "PREFETCH_GATHER", True)
    optimizer = optimizers.Adagrad(0.1)
    table = jnp.asarray(np.arange(24, dtype=F).reshape(8, 3))
    acc = jnp.ones((8, 3))
    fused = native.fused_rule(optimizer, None, table)
    step = jax.jit(
        lambda s, i: native.fused_update(
            s, optimizer, i, np.ones(2, bool), np.ones((2, 3), F), 0, *fused
        )
    )
    gather = jax.jit(native.gather_rows)
    for bad in ([1, 8], [1, -1]):
        bad = np.array(bad, np.int32)
        with pytest.raises(Exception, match="outside the table's rows"):
            jax.block_until_ready(step({"table": table, "accumulator": acc}, bad))
        with pytest.raises(Exception, match="outside the table's rows"):
            jax.block_until_ready(gather(table, bad, np.ones(2, bool)))
    np.testing.assert_array_equal(
        np.asarray(table), np.arange(24, dtype=F).reshape(8, 3)
    )
    np.testing.assert_array_equal(np.asarray(acc), np.ones((8, 3), F))


def test_subclasses_constraints_and_other_optimizers_take_the_xla_route():
    cases, (ids, valid, grads) = models.route_cases()
    rng = np.random.default_rng(0)
    for optimizer, constraint, expect_fused in cases:
        table, slots = models.random_state(optimizer, rng, 4, 4)
        _, fused = _apply(optimizer, table, slots, ids, valid, grads, 0, constraint)
        assert fused == expect_fused, optimizer
    _, fused = _apply(
        models.optimizer("sgd"), np.zeros((4, 4), "float16"), {}, ids, valid, grads, 0
    )
    assert fused  # 16-bit tables too (their rounding: test_compiled_rounding.py)


@pytest.mark.parametrize("form", ["layers", "collection"])
def test_models_train_alike_on_both_routes(form, monkeypatch):
    from keras_sparse.ops import dense_row_updates

    native = _module()
    # The model's 64 ids per step would update its 50-row tables densely.
    monkeypatch.setattr(dense_row_updates, "FORCE_DENSE_ROUTE", False)
    used = models.record_use(monkeypatch, native, "fused_update")
    monkeypatch.setattr(native, "PREFETCH_GATHER", True)  # gathers by the call
    for name in models.TRAINED:
        used.clear()
        fused = models.train(form, name)
        assert used and all(used), name  # every table's update is the call
        with models.switch(native, "FUSED_OPTIMIZERS", False):
            monkeypatch.setattr(native, "PREFETCH_GATHER", False)  # all XLA
            used.clear()
            reference = models.train(form, name)
            assert not used
            monkeypatch.setattr(native, "PREFETCH_GATHER", True)
        for got, want in zip(fused, reference):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_table_on_the_call_gets_no_dedup_scratch():
    import keras_sparse as ks

    _module()
    plain = ks.AllToAllDenseEmbedding(100, 4, optimizer="adagrad")
    plain.build((None, 2))
    clipped = ks.AllToAllDenseEmbedding(
        100, 4, optimizer="adagrad", embeddings_constraint="non_neg"
    )
    clipped.build((None, 2))
    assert not getattr(plain, "_dedup_scratch_by_table", {})
    assert clipped._dedup_scratch_by_table  # its update stays on XLA


def test_without_a_compiler_the_xla_route_runs(tmp_path):
    code = (
        "from keras_sparse.ops.jax import native_rows as j;"
        "print(j.library() is None);print(j.status())"
    )
    env = {
        **os.environ, "KERAS_SPARSE_CACHE": str(tmp_path), "CXX": "no-such-cxx",
        "KERAS_BACKEND": "jax",
    }  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    none, status = result.stdout.strip().splitlines()[-2:]
    assert none == "True"
    assert status == "off: no C compiler found ($CXX or c++)"


def test_only_training_steps_hold_the_custom_calls(monkeypatch):
    """Inference programs (what `model.export` and the serving export
    trace) gather with XLA: a custom call would tie them to this build."""
    import jax
    import jax.numpy as jnp

    import keras_sparse as ks
    from keras_sparse.ops.jax import lookup as jax_lookup

    native = _module()
    monkeypatch.setattr(native, "PREFETCH_GATHER", True)  # small tables too
    optimizer = ks.optimizers.Adagrad(0.1)
    table = jnp.zeros((300, 4))
    slots = {"accumulator": jnp.full((300, 4), 0.1)}
    ids, valid = jnp.arange(32) % 7, jnp.ones(32, bool)

    def lookup(apply_update):
        config = jax_lookup._Config(optimizer, None, apply_update)
        return lambda t, s: jax_lookup._lookup(config, t, s, ids, valid, 0, None)[0]

    def loss(t, s):
        return lookup(True)(t, s).sum()

    grad = jax.value_and_grad(loss, argnums=(0, 1))
    train = jax.jit(grad).lower(table, slots).as_text()
    assert "keras_sparse_gather_rows" in train and "keras_sparse_row_update" in train
    infer = jax.jit(lookup(False)).lower(table, slots).as_text()
    assert "keras_sparse_" not in infer
    inputs = keras.Input((3,), dtype="int32")
    layer = ks.AllToAllDenseEmbedding(300, 4, combiner="sum", optimizer=optimizer)
    model = keras.Model(inputs, layer(inputs))
    x = np.arange(12, dtype="int32").reshape(4, 3)
    served = jax.jit(lambda x: model(x, training=False)).lower(x).as_text()
    assert "custom_call" not in served


def test_the_forward_keeps_no_rows_for_the_call(monkeypatch):
    """Only XLA's route reads the touched rows back from the forward's
    gather; on the call's route the forward keeps none for the backward."""
    import jax.numpy as jnp

    from keras_sparse.ops.jax import lookup as jax_lookup

    native = _module()
    large = jnp.zeros((jax_lookup.FORWARD_ROWS_MIN_BYTES // 64, 16))
    config = jax_lookup._Config(models.optimizer("adagrad"), None)
    assert not jax_lookup._reuses_forward_rows(large, config)
    monkeypatch.setattr(native, "FUSED_OPTIMIZERS", False)
    assert jax_lookup._reuses_forward_rows(large, config)


def test_sharded_or_meshed_tables_keep_the_xla_route():
    """A table split over devices (an input's sharding, or a mesh in
    context) is partitioned by XLA; the call would need it whole."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    native = _module()
    optimizer = models.optimizer("adagrad")
    if len(jax.devices()) < 2:
        pytest.skip("needs several (virtual) devices")
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    split = jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh, P("model")))
    seen = []

    def probe(table):
        seen.append(native.fused_rule(optimizer, None, table) is not None)
        return table

    jax.jit(probe)(jnp.zeros((8, 4)))  # one device
    jax.jit(probe)(split)
    assert seen == [True, False]
    assert native.fused_rule(optimizer, None, split) is None
    with jax.set_mesh(mesh):
        jax.jit(probe)(jnp.zeros((8, 4)))
    assert seen[-1] is False


def test_the_calls_map_over_a_batch_axis(monkeypatch):
    """Under ``vmap`` each example's call runs in turn."""
    import jax
    import jax.numpy as jnp

    native = _module()
    monkeypatch.setattr(native, "PREFETCH_GATHER", True)
    optimizer = models.optimizer("sgd")
    fused = native.fused_rule(optimizer, None, jnp.zeros((2, 2)))
    tables = jnp.asarray(np.arange(2 * 5 * 3, dtype=F).reshape(2, 5, 3))
    ids = np.array([[0, 4], [2, 2]], np.int32)
    valid = np.ones((2, 2), bool)
    grads = np.ones((2, 2, 3), F)
    rows = jax.vmap(native.gather_rows)(tables, ids, valid)
    np.testing.assert_array_equal(
        np.asarray(rows), np.stack([np.asarray(tables)[b][ids[b]] for b in range(2)])
    )

    def update(table, i, v, g):
        return native.fused_update({"table": table}, optimizer, i, v, g, 0, *fused)

    out = np.asarray(jax.vmap(update)(tables, ids, valid, grads)["table"])
    for b in range(2):
        want = models.numpy_update(
            "sgd", optimizer, np.asarray(tables)[b], {}, ids[b], valid[b],
            grads[b], 0,
        )  # fmt: skip
        np.testing.assert_array_equal(out[b], want["table"])


def test_a_jax_without_the_ffi_module_leaves_the_call_off():
    """The flags read ``jax.ffi`` (JAX 0.5 on); where that fails the build
    reports why and the layers keep XLA's route, nothing raises."""
    from keras_sparse.ops import native_build

    def flags():
        raise AttributeError("module 'jax' has no attribute 'ffi'")

    library = native_build.source_library(
        "jax_rows_ffi", "jax_rows_ffi.cc", "CXX", "c++", flags, lambda path: path
    )
    assert library.get() is None
    assert library.status().startswith("off:") and "'ffi'" in library.status()


def test_the_helpers_list_every_compiled_optimizer():
    import keras_sparse as ks

    _module()  # skips where the compiled code cannot be built
    text = ks.compiled_cpu_helpers()
    assert text.startswith("on: ")
    assert "; optimizers: SGD, Adagrad, Adam, RowWiseAdagrad, Ftrl; " in text
