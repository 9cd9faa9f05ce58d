"""GPU tables inside compiled JAX steps through the in-place GPU buffer callback:
the keys stay on the device and training equals the CPU table's."""

import numpy as np
import pytest

from tests.gpu.gpu_layers import emulated
from tests.gpu.gpu_layers import hashed_model
from tests.gpu.gpu_layers import keys_and_targets
from tests.gpu.gpu_layers import require_cuda_and_jax
from tests.gpu.gpu_layers import sorted_records

cp = require_cuda_and_jax()

import keras  # noqa: E402

from keras_sparse.layers import jax_step_mapping  # noqa: E402
from keras_sparse.layers.hash_embedding import DistributedHashEmbedding  # noqa: E402


@pytest.fixture
def gpu_buffers(monkeypatch):
    monkeypatch.setattr(jax_step_mapping, "GPU_BUFFERS_IN_STEP", True)
    monkeypatch.setattr(jax_step_mapping, "_PROBE", {})  # probe again
    if emulated():
        # The emulated device is the host: the CPU step's buffers stand in
        # for the GPU step's, and the GPU route's callback runs on them.
        monkeypatch.setattr(jax_step_mapping, "_step_platform", lambda: "gpu")
        monkeypatch.setattr(jax_step_mapping, "_xla_stream", lambda ctx: 0)


def _model(table_device, **kwargs):
    return hashed_model(table_device, jit_compile=True, **kwargs)


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

    def no_host_keys(*args, **kwargs):
        raise AssertionError("keys went through the host mapping")

    monkeypatch.setattr(DistributedHashEmbedding, "_map_on_host", no_host_keys)
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


def test_gpu_buffer_route_full_table_error_names_the_layer(gpu_buffers):
    model, layer = _model("gpu", eviction=None)
    keys = np.arange(3000, dtype=np.int32).reshape(-1, 3)
    y = np.zeros((keys.shape[0], 1), "float32")
    with pytest.raises(Exception, match=r"'hashed'.*capacity=256"):
        for start in range(0, keys.shape[0], 16):
            model.train_on_batch(keys[start : start + 16], y[start : start + 16])
    assert 0 < layer.table.size <= 256


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
