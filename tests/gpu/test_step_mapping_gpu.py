"""GPU tables inside compiled JAX steps through the in-place GPU buffer callback:
the keys stay on the device and training equals the CPU table's."""

import os

import numpy as np
import pytest

from tests.gpu.gpu_layers import emulated
from tests.gpu.gpu_layers import hashed_model
from tests.gpu.gpu_layers import keys_and_targets
from tests.gpu.gpu_layers import require_cuda_and_jax
from tests.gpu.gpu_layers import sorted_records

cp = require_cuda_and_jax()

import keras  # noqa: E402

from keras_sparse.layers import jax_key_queue  # noqa: E402
from keras_sparse.layers.hash import jax_step_mapping  # noqa: E402
from keras_sparse.layers.hash.embedding import DistributedHashEmbedding  # noqa: E402


@pytest.fixture
def gpu_buffers(monkeypatch):
    monkeypatch.setattr(jax_step_mapping, "GPU_BUFFERS_IN_STEP", True)
    monkeypatch.setattr(jax_step_mapping, "_PROBE", {})  # probe again
    if emulated():
        # The emulated device is the host: the CPU step's buffers stand in
        # for the GPU step's, and the GPU route's callback runs on them.
        monkeypatch.setattr(jax_step_mapping, "_step_platform", lambda: "gpu")
        monkeypatch.setattr(jax_step_mapping, "_xla_stream", lambda ctx: 0)


class StepCounts(keras.callbacks.Callback):
    """Host syncs and kernel launches of each training step (emulated)."""

    def __init__(self):
        super().__init__()
        self.per_step = []

    def on_train_batch_begin(self, batch, logs=None):
        self.before = dict(cp.stats)

    def on_train_batch_end(self, batch, logs=None):
        counts = {k: cp.stats[k] - self.before[k] for k in ("syncs", "kernels")}
        self.per_step.append(counts)


def _model(table_device, **kwargs):
    return hashed_model(table_device, jit_compile=True, **kwargs)


def _forbid_host_mapping(monkeypatch):
    def no_host_keys(*args, **kwargs):
        raise AssertionError("keys went through the host mapping")

    monkeypatch.setattr(DistributedHashEmbedding, "map_host_keys", no_host_keys)


def test_route_is_the_gpu_buffer_callback(gpu_buffers):
    import jax

    platform = "cpu" if emulated() else "gpu"
    assert jax.default_backend() == platform
    _, layer = _model("gpu")
    assert jax_step_mapping.choose_route(layer) == "gpu_buffers"
    fn = jax.jit(lambda k, u: layer._map_keys(k, u, insert=True))
    hlo = fn.lower(np.zeros((4, 3), np.int32), np.ones(12, bool)).as_text()
    assert f"xla_buffer_python_{platform}_callback" in hlo, hlo[:2000]


def test_gpu_buffer_route_trains_like_the_cpu_table_without_host_keys(
    gpu_buffers, monkeypatch
):
    x, y = keys_and_targets()
    keras.utils.set_random_seed(0)
    model, layer = _model("cpu")
    hist = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    cpu = (hist.history["loss"], layer.export(), layer.stats())

    _forbid_host_mapping(monkeypatch)
    keras.utils.set_random_seed(0)
    model, layer = _model("gpu")
    hist = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    gpu = (hist.history["loss"], layer.export(), layer.stats())

    assert gpu[2]["evictions"] > 0
    assert gpu[2] == cpu[2]
    np.testing.assert_allclose(cpu[0], gpu[0], rtol=1e-5)
    a, b = sorted_records(cpu[1]), sorted_records(gpu[1])
    np.testing.assert_array_equal(a["keys"], b["keys"])
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, err_msg=name)


def test_gpu_buffer_route_keeps_wide_keys_apart_without_host_copies(
    gpu_buffers, monkeypatch
):
    """int64 keys beyond the int32 range through ``fit`` (JAX without x64
    truncates them in the step): the GPU route takes the queued full keys,
    checks them against the step's keys on the device, and trains like the
    CPU table; keys ``k`` and ``k + 2**32`` keep separate rows."""
    rng = np.random.default_rng(1)
    base = rng.integers(0, 300, size=(256, 3))
    x = np.where(rng.random((256, 3)) < 0.5, base, base + (1 << 32)).astype("int64")
    y = rng.normal(size=(256, 1)).astype("float32")

    def fit(table_device):
        keras.utils.set_random_seed(0)
        model, layer = _model(
            table_device, key_dtype="int64", embeddings_initializer="uniform"
        )
        hist = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        return hist.history["loss"], sorted_records(layer.export()), layer.stats()

    cpu = fit("cpu")
    # The step's keys reach the full-key check as device arrays.
    checked = []
    restore = jax_key_queue.restore

    def restore_on_device(layer, keys, xp=np):
        checked.append(isinstance(keys, cp.ndarray) and xp is cp)
        return restore(layer, keys, xp)

    _forbid_host_mapping(monkeypatch)
    monkeypatch.setattr(jax_key_queue, "restore", restore_on_device)
    gpu = fit("gpu")
    assert checked and all(checked)
    assert gpu[2]["evictions"] > 0 and gpu[2] == cpu[2]
    np.testing.assert_array_equal(cpu[1]["keys"], gpu[1]["keys"])
    assert (gpu[1]["keys"] >= 1 << 32).any() and (gpu[1]["keys"] < 1 << 32).any()
    # XLA's GPU reductions and scatter-adds run in no fixed order (two runs
    # of one model on an H100 differed by 2e-3 in this loss); with
    # --xla_gpu_deterministic_ops=true (tests/run.sh sets it) the two tables
    # train bit-identically, as on the emulated device.
    exact = emulated() or "deterministic_ops=true" in os.environ.get("XLA_FLAGS", "")
    rtol = 1e-6 if exact else 1e-2
    np.testing.assert_allclose(cpu[0], gpu[0], rtol=rtol)
    for name in cpu[1]:
        np.testing.assert_allclose(cpu[1][name], gpu[1][name], rtol=rtol, err_msg=name)


def test_gpu_buffer_route_full_table_error_names_the_layer(gpu_buffers, monkeypatch):
    """A full table (eviction=None) fails the step with an error naming the
    layer. On a GPU, JAX dispatches steps without waiting, so the error shows
    when a result is read; the steps queued after the failed one leave the
    table alone."""
    model, layer = _model("gpu", eviction=None)
    keys = np.arange(3000, dtype=np.int32).reshape(-1, 3)
    y = np.zeros((keys.shape[0], 1), "float32")
    calls = []
    original = DistributedHashEmbedding._lookup_or_insert

    def logged(self, k):
        calls.append(self.table.export())
        return original(self, k)

    monkeypatch.setattr(DistributedHashEmbedding, "_lookup_or_insert", logged)
    with pytest.raises(Exception, match=r"'hashed'.*capacity=256"):
        for start in range(0, keys.shape[0], 16):
            loss = model.train_on_batch(keys[start : start + 16], y[start : start + 16])
        np.asarray(loss)  # reading a result reports the failed step
    assert 0 < layer.table.size <= 256
    # The failing call was the last to reach the table, which it left as is.
    for before, after in zip(calls[-1], layer.table.export()):
        np.testing.assert_array_equal(cp.asnumpy(before), cp.asnumpy(after))


def test_probe_finds_the_gpu_buffer_route_working(gpu_buffers):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warning would fail here
        assert jax_step_mapping.gpu_buffers_work()
    assert jax_step_mapping._PROBE == {"result": True}


@pytest.mark.parametrize("failure", ["raises", "wrong values"])
def test_failed_probe_falls_back_to_io_callback_and_trains(
    gpu_buffers, monkeypatch, failure
):
    """Where CuPy cannot use XLA's buffers the GPU table keeps the
    io_callback route, says so once, and training is unaffected."""

    def broken_probe():
        if failure == "raises":
            raise RuntimeError("no CUDA array interface")
        return False

    monkeypatch.setattr(jax_step_mapping, "_probe_gpu_buffers", broken_probe)
    x, y = keys_and_targets()
    keras.utils.set_random_seed(0)
    model, layer = _model("gpu")
    with pytest.warns(RuntimeWarning, match="io_callback route"):
        assert jax_step_mapping.choose_route(layer) == "io_callback"
    hist = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert np.isfinite(hist.history["loss"]).all()
    assert layer.stats()["inserts"] > 0
    assert jax_step_mapping._PROBE == {"result": False}


def test_probe_fails_when_writes_miss_xla_buffers(gpu_buffers, monkeypatch):
    """If CuPy wrapped XLA's buffers by copying them, the table's rows would
    never reach the step: the probe sees the step's output unchanged."""
    original = cp.asarray
    monkeypatch.setattr(cp, "asarray", lambda a, *args, **kw: original(a).copy())
    assert jax_step_mapping._probe_gpu_buffers() is False


def test_gpu_buffer_route_steps_without_host_syncs(gpu_buffers, monkeypatch):
    """Each training step maps its keys with one kernel launch and no host
    sync (the table's counts stay on the device until ``stats()`` reads
    them), and the counts then equal the CPU table's."""
    if not emulated():
        pytest.skip("launches and syncs are counted by the emulated CuPy")
    x, y = keys_and_targets()
    keras.utils.set_random_seed(0)
    model, layer = _model("cpu")
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    cpu = layer.stats()

    count = StepCounts()
    _forbid_host_mapping(monkeypatch)
    keras.utils.set_random_seed(0)
    model, layer = _model("gpu")
    model.fit(
        x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[count]
    )
    assert len(count.per_step) == len(x) // 32
    assert count.per_step == [{"syncs": 0, "kernels": 1}] * len(count.per_step)
    assert layer.stats() == cpu and cpu["evictions"] > 0


@pytest.mark.parametrize("route", ["block", "grid"])
def test_hash_fields_together_take_one_launch_per_step(gpu_buffers, monkeypatch, route):
    """A `HashEmbeddingCollection` of three GPU-table fields maps every
    training step with one kernel launch (one block per field, or with
    fields above the one-block limit, lowered here, every block on each
    field in turn) and no host sync, and trains exactly like the same
    fields as separate CPU-table layers: losses, counters, stored records."""
    if not emulated():
        pytest.skip("launches and syncs are counted by the emulated CuPy")
    if route == "grid":
        from keras_sparse.table import insert_call

        monkeypatch.setattr(insert_call, "MAX_KEYS", 4)
    from tests.hash_fields import FIELDS
    from tests.hash_fields import fields_data
    from tests.hash_fields import fields_model

    _without_admission(FIELDS, monkeypatch)
    x, y = fields_data(samples=128)
    fit = dict(batch_size=16, epochs=1, shuffle=False, verbose=0)
    keras.utils.set_random_seed(0)
    model, cpu_layers = fields_model(False, "cpu", jit_compile=True)
    cpu_loss = model.fit(x, y, **fit).history["loss"]

    count = StepCounts()
    _forbid_host_mapping(monkeypatch)
    keras.utils.set_random_seed(0)
    model, gpu_layers = fields_model(True, "gpu", jit_compile=True)
    gpu_loss = model.fit(x, y, callbacks=[count], **fit).history["loss"]
    assert count.per_step == [{"syncs": 0, "kernels": 1}] * (len(y) // 16)
    np.testing.assert_allclose(gpu_loss, cpu_loss, rtol=1e-5)
    for name in FIELDS:
        cpu, gpu = cpu_layers[name], gpu_layers[name]
        assert gpu.stats() == cpu.stats()
        a, b = sorted_records(cpu.export()), sorted_records(gpu.export())
        np.testing.assert_array_equal(a["keys"], b["keys"])
        for part in a:
            np.testing.assert_allclose(a[part], b[part], rtol=1e-5, err_msg=part)
    assert gpu_layers["user"].stats()["evictions"] > 0


def test_hash_fields_together_restore_wide_keys_with_one_check(
    gpu_buffers, monkeypatch
):
    """Wide int64 keys (JAX without x64) into a `HashEmbeddingCollection` of
    GPU-table fields: the fields' full keys reach the device in one copy and
    are checked with one host read per training step (two syncs in all,
    however many fields), also around validation batches queued in between;
    training equals the same fields as separate CPU-table layers."""
    from tests.hash_fields import FIELDS
    from tests.hash_fields import fields_data
    from tests.hash_fields import fields_model

    _without_admission(FIELDS, monkeypatch)
    x, y = fields_data(samples=128)
    rng = np.random.default_rng(2)
    for name in FIELDS:
        wide = rng.random(x[name].shape) < 0.5
        x[name] = np.where(wide, x[name] + (np.int64(1) << 32), x[name]).astype("int64")
    val = ({k: v[:32] for k, v in x.items()}, y[:32])
    fit = dict(batch_size=16, epochs=2, shuffle=False, verbose=0, validation_data=val)
    keras.utils.set_random_seed(0)
    model, cpu_layers = fields_model(False, "cpu", jit_compile=True, key_dtype="int64")
    cpu = model.fit(x, y, **fit).history

    count = StepCounts() if emulated() else keras.callbacks.Callback()
    _forbid_host_mapping(monkeypatch)
    keras.utils.set_random_seed(0)
    model, gpu_layers = fields_model(True, "gpu", jit_compile=True, key_dtype="int64")
    gpu = model.fit(x, y, callbacks=[count], **fit).history
    if emulated():
        assert count.per_step == [{"syncs": 1, "kernels": 1}] * (2 * len(y) // 16)
    exact = emulated() or "deterministic_ops=true" in os.environ.get("XLA_FLAGS", "")
    rtol = 1e-5 if exact else 1e-2
    np.testing.assert_allclose(gpu["loss"], cpu["loss"], rtol=rtol)
    np.testing.assert_allclose(gpu["val_loss"], cpu["val_loss"], rtol=rtol)
    for name in FIELDS:
        a = sorted_records(cpu_layers[name].export())
        b = sorted_records(gpu_layers[name].export())
        np.testing.assert_array_equal(a["keys"], b["keys"])
        assert (a["keys"] >= 1 << 32).any()
        for part in a:
            np.testing.assert_allclose(a[part], b[part], rtol=rtol, err_msg=part)


def _without_admission(fields, monkeypatch):
    """Admission (exact counts in a second table) takes the multi-launch
    path: the one-launch tests use fields without it."""
    for name, (args, width) in list(fields.items()):
        if args.get("admit_after", 1) > 1:
            monkeypatch.setitem(fields, name, ({**args, "admit_after": 1}, width))
