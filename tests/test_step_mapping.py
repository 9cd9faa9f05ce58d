"""How compiled JAX steps reach a DistributedHashEmbedding's table: the
in-place buffer callback on one device, the ordered io_callback under a
distribution or when forced; both give identical training."""

import keras
import numpy as np
import pytest

from keras_sparse.layers.hash import jax_step_mapping
from keras_sparse.layers.hash.embedding import DistributedHashEmbedding
from tests.conftest import backend

pytestmark = pytest.mark.skipif(
    backend() != "jax", reason="the compiled-step routes are JAX's"
)

FIELDS, DIM = 3, 4
IN_PLACE_TARGET = "xla_buffer_python_cpu_callback"


def _layer(**kwargs):
    kwargs.setdefault("optimizer", "adagrad")
    kwargs.setdefault("name", "hashed")
    return DistributedHashEmbedding(
        DIM,
        capacity=64,
        combiner="sum",
        embeddings_initializer=keras.initializers.RandomUniform(seed=3),
        **kwargs,
    )


def _model(layer):
    ids = keras.Input((FIELDS,), dtype="int64")
    model = keras.Model(ids, keras.layers.Dense(1)(layer(ids)))
    model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=True)
    return model


def _data():
    rng = np.random.default_rng(0)
    # 200 distinct keys beyond the int32 range for a 64-row table: eviction
    # pressure, and the full-key restore of JAX without x64 on every step.
    keys = (np.int64(7) << 40) + rng.integers(0, 200, size=(256, FIELDS))
    return keys, rng.normal(size=(256, 1)).astype("float32")


def _mapping_hlo(layer):
    import jax

    keys = np.zeros((8, FIELDS), np.int32)
    use = np.ones((8 * FIELDS,), bool)
    layer.build((None, FIELDS))
    fn = jax.jit(lambda k, u: layer._map_keys(k, u, insert=True))
    return fn.lower(keys, use).as_text()


def _set_in_place(monkeypatch, value):
    monkeypatch.setattr(jax_step_mapping, "IN_PLACE_CALLBACKS", value)


def test_one_device_step_uses_the_in_place_callback(monkeypatch):
    assert IN_PLACE_TARGET in _mapping_hlo(_layer())
    _set_in_place(monkeypatch, False)
    assert IN_PLACE_TARGET not in _mapping_hlo(_layer())


def _mapping_effects(layer):
    import jax

    keys = np.zeros((8, FIELDS), np.int32)
    use = np.ones((8 * FIELDS,), bool)
    layer.build((None, FIELDS))
    closed = jax.make_jaxpr(lambda k, u: layer._map_keys(k, u, insert=True))
    return closed(keys, use).effects


def test_in_place_step_mapping_has_no_effects_outside_remat():
    """JAX dispatches a step from C++ only when its program has no effects,
    so the in-place callback declares none; under a Keras ``RematScope``
    (which would call the table again to recompute the rows) it keeps its
    effect, which rematerialization then refuses."""
    assert not _mapping_effects(_layer())
    with keras.RematScope(mode="full"):
        assert _mapping_effects(_layer(name="remat"))


def test_calls_keras_rematerializes_are_seen_when_traced():
    """A layer built under a ``RematScope`` and called outside it is
    rematerialized (its forward pass may run again in the backward pass):
    step callbacks traced inside it keep their effect."""
    from keras_sparse.layers import jax_full_keys

    jax_full_keys.install()  # installs the watch, as building a layer does
    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            seen.append(jax_step_mapping.rematerializing())
            return x * 2.0

    with keras.RematScope(mode="full"):
        remat_layer = Probe()
    plain_layer = Probe()
    x = np.ones((2, 3), "float32")
    remat_layer(x)
    plain_layer(x)
    assert seen == [True, False]


def test_in_place_step_is_dispatched_by_the_fast_path(monkeypatch):
    """After its first call, the compiled training step of a hash layer runs
    from JAX's C++ dispatch: the Python dispatch path (which an effect
    forces, 2-5 ms of host time per step) is never entered, and training
    still looks each key up once per step."""
    from jax._src.interpreters import pxla

    layer = _layer()
    model = _model(layer)
    keys, y = _data()
    model.fit(keys[:64], y[:64], batch_size=16, epochs=1, shuffle=False, verbose=0)
    before = layer.stats()
    python_dispatches = []
    real = pxla.ExecuteReplicated.__call__

    def counted(self, *args):
        python_dispatches.append(1)
        return real(self, *args)

    monkeypatch.setattr(pxla.ExecuteReplicated, "__call__", counted)
    model.fit(keys[64:128], y[64:128], batch_size=16, shuffle=False, verbose=0)
    assert python_dispatches == []
    after = layer.stats()
    looked_up = sum(after[k] - before[k] for k in ("hits", "misses"))
    assert looked_up == 64 * FIELDS


def test_distributed_step_uses_the_io_callback():
    import jax

    devices = jax.devices()
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=devices)
    )
    try:
        assert jax_step_mapping.choose_route(_layer()) == "io_callback"
        assert IN_PLACE_TARGET not in _mapping_hlo(_layer())
    finally:
        keras.distribution.set_distribution(None)


def test_shared_layer_keeps_the_ordered_io_callback():
    layer = _layer()
    a = keras.Input((FIELDS,), dtype="int64")
    b = keras.Input((FIELDS,), dtype="int64")
    assert jax_step_mapping.choose_route(layer) == "cpu_buffers"
    keras.Model([a, b], keras.layers.Add()([layer(a), layer(b)]))
    assert jax_step_mapping.choose_route(layer) == "io_callback"


def test_layers_given_one_table_keep_the_ordered_io_callback():
    """Two layers sharing one table object: in-place callbacks of different
    layers may run concurrently, so both take the ordered route and their
    table calls keep the program order; a third layer keeps its own."""
    first, second, own = _layer(name="a"), _layer(name="b"), _layer(name="c")
    inputs = [keras.Input((FIELDS,), dtype="int64") for _ in range(3)]
    outs = [layer(x) for layer, x in zip((first, second, own), inputs)]
    keras.Model(inputs, keras.layers.Add()(outs))
    assert jax_step_mapping.choose_route(second) == "cpu_buffers"
    second.table = first.table
    for layer in (first, second):
        assert jax_step_mapping.calls_per_step(layer) == 2
        assert jax_step_mapping.choose_route(layer) == "io_callback"
    assert jax_step_mapping.choose_route(own) == "cpu_buffers"


def _fit(monkeypatch, in_place):
    _set_in_place(monkeypatch, in_place)
    keras.utils.set_random_seed(0)
    layer = _layer()
    model = _model(layer)
    keys, y = _data()
    hist = model.fit(keys, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    records = layer.export()
    order = np.argsort(records["keys"])
    return hist.history["loss"], {k: v[order] for k, v in records.items()}, layer


def test_both_routes_train_identically_under_eviction(monkeypatch):
    loss_a, rec_a, layer_a = _fit(monkeypatch, True)
    loss_b, rec_b, layer_b = _fit(monkeypatch, False)
    np.testing.assert_array_equal(loss_a, loss_b)
    assert rec_a.keys() == rec_b.keys()
    for name in rec_a:
        np.testing.assert_array_equal(rec_a[name], rec_b[name], err_msg=name)
    # The full 64-bit keys reached the table, and eviction happened.
    assert (rec_a["keys"] >> 40 == 7).all()
    assert layer_a.stats()["evictions"] > 0
    assert layer_a.stats() == layer_b.stats()


def test_full_table_in_a_compiled_step_raises_before_the_table_changes():
    """The error names layer, capacity and size; the table keeps the state
    of the last good step. (The failed step's donated model variables are
    lost, as for any error inside a compiled Keras step: see the layer's
    docstring.)"""
    layer = _layer(optimizer="sgd", eviction=None)
    model = _model(layer)
    keys = np.arange(3600, dtype=np.int64).reshape(-1, FIELDS)
    y = np.zeros((keys.shape[0], 1), "float32")
    with pytest.raises(Exception, match=r"'hashed'.*capacity=64, size=\d+"):
        for start in range(0, keys.shape[0], 4):
            before = layer.table.export()
            stats = layer.stats()
            model.train_on_batch(keys[start : start + 4], y[start : start + 4])
    after = layer.table.export()
    assert 0 < layer.table.size <= 64
    for b, a in zip(before, after):
        np.testing.assert_array_equal(b, a)
    assert layer.stats() == stats


def test_a_failed_step_callback_stops_later_ones_of_the_layer():
    """After one compiled step's table call failed, the steps queued behind
    it (on a GPU they may run before the error is read) fail without
    calling the table; other layers are unaffected."""
    calls = []

    def table_call(*args):
        calls.append(args)
        if args[0] == "full":
            raise ValueError("table full")
        return "rows"

    layer, other = _layer(), _layer(name="other")
    guarded = jax_step_mapping._failing_once(layer, table_call)
    assert guarded("a") == "rows"
    with pytest.raises(ValueError, match="table full"):
        guarded("full")
    with pytest.raises(RuntimeError, match=r"'hashed'.*ValueError: table full"):
        guarded("b")
    assert calls == [("a",), ("full",)]
    assert jax_step_mapping._failing_once(other, table_call)("c") == "rows"
