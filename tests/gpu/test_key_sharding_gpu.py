"""Key-sharded DistributedHashEmbedding with GPU table shards (JAX): each
shard a CUDA table on its device's GPU (on CPU devices, as here under the
emulation, on GPU 0), trained like CPU shards key by key."""

import numpy as np

from tests.gpu.gpu_layers import require_cuda_and_jax

cp = require_cuda_and_jax()

import jax  # noqa: E402
import keras  # noqa: E402

import keras_sparse as ks  # noqa: E402
from keras_sparse import sharding  # noqa: E402
from tests.helpers import fit_losses  # noqa: E402

BAG, BATCH = 3, 32


def _run(table_device):
    devices = min(8, len(jax.devices()))
    layer = ks.DistributedHashEmbedding(
        4,
        capacity=1024,
        combiner="sum",
        optimizer="adagrad",
        admit_after=2,
        sharding="key",
        table_device=table_device,
        name="hashed",
    )
    keras.distribution.set_distribution(sharding.distribution([layer], devices))
    try:
        keys = keras.Input((BAG,), dtype="int64")
        model = keras.Model(keys, keras.layers.Dense(1)(layer(keys)))
        model.compile(keras.optimizers.SGD(0.05), "mse")
        rng = np.random.default_rng(0)
        x = rng.integers(0, 300, (BATCH * 4, BAG)) * 7_919_993_123
        y = rng.normal(size=(BATCH * 4, 1)).astype("float32")
        keras.utils.set_random_seed(0)
        model.set_weights([np.full(w.shape, 0.1, w.dtype) for w in model.weights])
        losses = fit_losses(model, x, y, BATCH)
        return losses, layer
    finally:
        keras.distribution.set_distribution(None)


def test_gpu_shards_train_like_cpu_shards():
    cpu_losses, cpu = _run("cpu")
    gpu_losses, gpu = _run("gpu")
    assert gpu.table.device == "gpu" and gpu.table.num_shards == cpu.table.num_shards
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-6, atol=1e-6)
    a, b = cpu.export(), gpu.export()
    oa, ob = np.argsort(a["keys"]), np.argsort(b["keys"])
    assert len(a["keys"]) > 20
    np.testing.assert_array_equal(a["keys"][oa], b["keys"][ob])
    np.testing.assert_array_equal(a["scores"][oa], b["scores"][ob])
    np.testing.assert_allclose(a["values"][oa], b["values"][ob], atol=1e-6)
    assert gpu.stats() == cpu.stats()
