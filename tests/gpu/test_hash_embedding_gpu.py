"""DistributedHashEmbedding with its table on the GPU (CuPy), JAX backend."""

import numpy as np

from tests.gpu.gpu_layers import hashed_model
from tests.gpu.gpu_layers import keys_and_targets
from tests.gpu.gpu_layers import require_cuda_and_jax
from tests.gpu.gpu_layers import require_real_gpu

cp = require_cuda_and_jax()

import keras  # noqa: E402

import keras_sparse as ks  # noqa: E402

_model = hashed_model
_data = keys_and_targets


def test_gpu_table_trains_like_the_cpu_table():
    x, y = _data()
    runs = {}
    for device in ("cpu", "gpu"):
        keras.utils.set_random_seed(0)
        model, layer = _model(device)
        assert layer.table.device == device
        hist = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        runs[device] = (hist.history["loss"], layer.export())
    np.testing.assert_allclose(runs["cpu"][0], runs["gpu"][0], rtol=1e-5)
    a, b = runs["cpu"][1], runs["gpu"][1]
    oa, ob = np.argsort(a["keys"]), np.argsort(b["keys"])
    np.testing.assert_array_equal(a["keys"][oa], b["keys"][ob])
    np.testing.assert_allclose(a["values"][oa], b["values"][ob], rtol=1e-5)


def test_eager_call_keeps_device_keys_on_the_gpu():
    import jax

    require_real_gpu("a JAX array on the GPU")
    _, layer = _model("gpu")
    keys = jax.device_put(np.array([[5, 6, 7]], np.int32), jax.devices("gpu")[0])
    out = layer(keys, training=True)
    assert out.devices() == {jax.devices("gpu")[0]}
    assert layer.stats()["size"] == 3


def test_prefetch_with_gpu_tables_trains_like_the_slow_cpu_path():
    """Worker threads drive the CUDA tables; under eviction pressure (400 keys,
    capacity 256) the result equals the callback path on a CPU table."""
    x, y = _data()
    runs = {}
    for device in ("cpu", "gpu"):
        keras.utils.set_random_seed(0)
        model, layer = _model(device)
        if device == "cpu":
            hist = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        else:
            with ks.data.prefetch((x, y), model, batch_size=32, threads=3) as stage:
                hist = model.fit(stage, epochs=2, verbose=0)
        runs[device] = (hist.history["loss"], layer.export(), layer.stats())
    assert runs["gpu"][2]["evictions"] > 0
    np.testing.assert_allclose(runs["cpu"][0], runs["gpu"][0], rtol=1e-5)
    a, b = runs["cpu"][1], runs["gpu"][1]
    oa, ob = np.argsort(a["keys"]), np.argsort(b["keys"])
    np.testing.assert_array_equal(a["keys"][oa], b["keys"][ob])
    np.testing.assert_allclose(a["values"][oa], b["values"][ob], rtol=1e-5)


def test_eager_calls_match_the_cpu_table():
    """Eager calls (host keys in, rows back through DLPack): the GPU table
    gives the CPU table's vectors and counters, inserting and not."""
    keys = np.array([[5, 6, 7], [7, 8, 5]], np.int64) * (2**40 + 1)
    outs = {}
    for device in ("cpu", "gpu"):
        keras.utils.set_random_seed(0)
        _, layer = _model(device)
        trained = layer(keys, training=True)
        unseen = layer(keys + 1, training=False)  # unknown keys read zeros
        outs[device] = (np.asarray(trained), np.asarray(unseen), layer.stats())
    np.testing.assert_array_equal(outs["cpu"][0], outs["gpu"][0])
    np.testing.assert_array_equal(outs["gpu"][1], 0.0)
    assert outs["cpu"][2] == outs["gpu"][2]
    assert outs["gpu"][2]["size"] == 4
