"""Tables with ``cache_rows`` under a Keras distribution (JAX, 8 devices)
train as the same tables wholly on the devices.

The cache is replicated: the step's host callback sees the whole batch,
so one id map and one store serve every device's copy of the cache. The
layer under test keeps 40 of its 300 rows on the devices; the reference
is the same model and distribution without ``cache_rows``, starting from
the same table and head. Every id's values and optimizer slots must match
exactly (and a model on one device, up to the rounding of the head's
cross-device gradient sums), through ``model.fit``, through
``ks.data.prefetch`` and under a ModelParallel layout of the head. A batch
the cache cannot map is refused before its step. Several JAX processes:
`test_jax_processes_cache.py`.
"""

import keras
import numpy as np
import pytest

import keras_sparse as ks
from tests import cached_tables
from tests.cached_tables import VOCAB

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="a Keras distribution (JAX)"
)

CACHE, BATCH, STEPS = 40, 16, 12


def _data(seed=0):
    return cached_tables.data(BATCH, STEPS, seed)


def _distribution(how="fit"):
    """DataParallel over 8 devices; with ``how="model_parallel"`` a
    ModelParallel whose layout map splits the head (the cache replicated)."""
    devices = keras.distribution.list_devices()
    assert len(devices) == 8, "run with --xla_force_host_platform_device_count=8"
    if how != "model_parallel":
        return keras.distribution.DataParallel(devices=devices)
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices)
    layout = keras.distribution.LayoutMap(mesh)
    layout["out/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch")


def _train(kind, optimizer, cache, start, how="fit", distributed=True):
    """``(state, predictions, layer, start)`` of a model trained from
    ``start`` (the table and head; None: the model's own); ``how``: "fit",
    "prefetch" (through the input stage) or "model_parallel"."""
    if distributed:
        keras.distribution.set_distribution(_distribution(how))
    try:
        keras.utils.set_random_seed(3)
        model, layer = cached_tables.build(kind, optimizer, cache)
        model.compile(optimizer="sgd", loss="mse")
        start = cached_tables.start_from(model, layer, kind, start)
        x, y = _data()
        x = x["a"] if kind == "dense" else x
        if how == "prefetch" and cache:  # the cache maps ids in the step
            model.fit(ks.data.prefetch((x, y), model, batch_size=BATCH), verbose=0)
        else:
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        probe = _data(1)[0]
        probe = probe["a"] if kind == "dense" else probe
        predicted = model.predict(probe, batch_size=BATCH, verbose=0)
        state = cached_tables.state(kind, layer)
    finally:
        keras.distribution.set_distribution(None)
    return state, predicted, layer, start


@pytest.mark.parametrize(
    "kind, optimizer, how",
    [("dense", "sgd", "fit"), ("dense", "adagrad", "fit"),
     ("collection", "sgd", "fit"), ("collection", "adagrad", "fit"),
     ("dense", "adagrad", "prefetch"), ("collection", "sgd", "prefetch"),
     ("dense", "sgd", "model_parallel")],
)  # fmt: skip
def test_a_replicated_cache_trains_as_the_whole_table(kind, optimizer, how):
    cache = {"cache_rows": CACHE, "store": "host"}
    got, got_pred, layer, start = _train(kind, optimizer, cache, None, how)
    stats = layer.stats() if kind == "dense" else layer.stats("a")
    # Rows went down to the store and came back: the cache was too small.
    assert stats["evictions"] >= 100 and stats["fills"] >= stats["evictions"], stats
    assert stats["store_size"] == VOCAB
    if how == "prefetch":  # the stage mapped every batch ahead of its step
        assert stats["used_ahead"] == stats["mapped_ahead"] == STEPS, stats
    want, want_pred, _, _ = _train(kind, optimizer, {}, start, how)
    assert sorted(got) == sorted(want) and len(want) >= 2 + (optimizer == "adagrad")
    for key, value in want.items():
        if kind == "collection" and key.startswith("b:"):
            # Table "b" shares a stack with "a" only in the reference, so
            # its updates are summed in another order.
            np.testing.assert_allclose(got[key], value, atol=1e-7, err_msg=key)
        else:
            np.testing.assert_array_equal(got[key], value, err_msg=key)
    # Inference reads the ids the cache does not hold from the store.
    np.testing.assert_allclose(got_pred, want_pred, rtol=0, atol=1e-7)
    if (kind, optimizer, how) == ("dense", "adagrad", "fit"):  # one device
        one, one_pred, _, _ = _train(kind, optimizer, {}, start, distributed=False)
        for key, value in one.items():
            np.testing.assert_allclose(got[key], value, atol=1e-6, err_msg=key)
        np.testing.assert_allclose(got_pred, one_pred, atol=1e-6)


@pytest.mark.parametrize("kind", ["dense", "collection"])
@pytest.mark.parametrize("bad", ["out_of_range", "too_many_ids"])
def test_a_batch_the_cache_cannot_map_is_refused_before_the_step(kind, bad):
    """Raised inside the step, the error would leave the other devices
    waiting at their first collective until XLA aborts the process."""
    keras.distribution.set_distribution(_distribution())
    try:
        cache = {"cache_rows": CACHE, "store": "host"}
        model, layer = cached_tables.build(kind, "sgd", cache)
        model.compile(optimizer="sgd", loss="mse")
        x, y = _data()
        ids = x["a"][:BATCH]
        model.fit(ids if kind == "dense" else {k: v[:BATCH] for k, v in x.items()},
                  y[:BATCH], batch_size=BATCH, verbose=0)  # fmt: skip
        # Inference needs no free rows: a batch of more distinct ids than
        # cache_rows predicts (ids the cache does not hold: from the store).
        wide = np.arange(2 * BATCH * 2, dtype="int32").reshape(2 * BATCH, 2)
        feed = wide if kind == "dense" else {"a": wide, "b": x["b"][: 2 * BATCH]}
        assert np.isfinite(model.predict(feed, batch_size=2 * BATCH, verbose=0)).all()
        before = layer.stats() if kind == "dense" else layer.stats("a")
        ids = ids.copy()
        if bad == "out_of_range":
            ids[3, 1] = VOCAB
            match = f"id {VOCAB} is out of range"
        else:
            ids = np.arange(2 * BATCH * 2, dtype="int32").reshape(2 * BATCH, 2)
            match = f"{2 * BATCH * 2} distinct ids, more than cache_rows={CACHE}"
        n = len(ids)
        feed = ids if kind == "dense" else {"a": ids, "b": x["b"][:n]}
        with pytest.raises(ValueError, match=match) as info:
            model.fit(feed, y[:n], batch_size=n, verbose=0)
        assert ("Layer 'ids'" if kind == "dense" else "Layer 'f' table 'a'") in str(
            info.value
        )
        after = layer.stats() if kind == "dense" else layer.stats("a")
        assert after == before  # nothing mapped, nothing moved
        if bad == "out_of_range":  # refused before Keras took the state
            assert all(v._value is not None for v in model.variables)
    finally:
        keras.distribution.set_distribution(None)


def test_a_model_saved_under_the_distribution_loads_on_one_device(tmp_path):
    """The save streams the whole table (store rows, the cached ones over
    them) from the replicated cache; it loads into one device's cache."""
    keras.distribution.set_distribution(_distribution())
    try:
        cache = {"cache_rows": CACHE, "store": "host"}
        model, layer = cached_tables.build("dense", "adagrad", cache)
        model.compile(optimizer="sgd", loss="mse")
        x, y = _data()
        model.fit(x["a"], y, batch_size=BATCH, shuffle=False, verbose=0)
        assert layer.stats()["evictions"] > 0
        model.save(tmp_path / "m.keras")
        want = layer.get_weights()
        probe = _data(1)[0]["a"]
        want_pred = model.predict(probe, batch_size=BATCH, verbose=0)
    finally:
        keras.distribution.set_distribution(None)
    loaded = keras.models.load_model(tmp_path / "m.keras")
    for got, value in zip(loaded.get_layer("ids").get_weights(), want):
        np.testing.assert_array_equal(got, value)
    got_pred = loaded.predict(probe, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(got_pred, want_pred, rtol=0, atol=1e-6)
