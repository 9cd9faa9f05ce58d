"""Checkpoints of GPU hash tables: restored rows match the CPU twin's."""

import warnings

import numpy as np
import pytest

from tests.gpu.gpu_layers import require_cuda

cp = require_cuda()

from keras_sparse.layers.hash.embedding import DistributedHashEmbedding  # noqa: E402
from keras_sparse.table import HashTable  # noqa: E402


def _host(x):
    return x.get() if isinstance(x, cp.ndarray) else np.asarray(x)


def test_gpu_table_restored_at_rows_inserts_like_the_cpu_twin():
    rng = np.random.default_rng(0)
    source = HashTable(512, eviction="lru", device="cpu")
    for step in range(1, 12):
        source.lookup_or_insert(rng.integers(0, 10**6, 48), step=step)
    keys, rows, _ = source.export()
    source.erase(keys[(rows < 128) & (rows % 16 == 0)])  # holes in 8 buckets
    keys, rows, scores = source.export()
    cpu = HashTable(512, eviction="lru", device="cpu")
    gpu = HashTable(512, eviction="lru", device="gpu")
    cpu.import_(keys, rows, scores)
    gpu.import_(keys, rows, scores)
    np.testing.assert_array_equal(_host(gpu._impl.holey), cpu._impl.holey)
    for step in range(12, 40):
        batch = rng.integers(0, 10**6, 48)
        a = cpu.lookup_or_insert(batch, step=step)
        b = gpu.lookup_or_insert(cp.asarray(batch), step=step)
        np.testing.assert_array_equal(_host(b.rows), a.rows)
    for x, y in zip(cpu.export(), gpu.export()):
        np.testing.assert_array_equal(_host(y), x)


def _layer(capacity, table_device):
    return DistributedHashEmbedding(
        3, capacity=capacity, optimizer="adagrad", table_device=table_device
    )


def test_gpu_layer_checkpoint_loads_on_either_device():
    rng = np.random.default_rng(1)
    source = _layer(256, "gpu")
    source.build()
    n = 400
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # more keys than fit: some dropped
        source.import_(
            rng.choice(2**40, n, replace=False),
            rng.normal(size=(n, 3)),
            {"accumulator": rng.uniform(0.1, 1, size=(n, 3))},
            rng.integers(0, 100, n),
        )
    store = {}
    source.save_own_variables(store)
    saved = source.export(include_rows=True)
    for device in ("gpu", "cpu"):
        target = _layer(256, device)
        target.load_own_variables(store)
        got = target.export(include_rows=True)
        for name in saved:
            np.testing.assert_array_equal(got[name], saved[name], err_msg=name)
    smaller = _layer(64, "gpu")
    with pytest.warns(UserWarning, match="saved keys were dropped on load"):
        smaller.load_own_variables(store)
    assert 0 < smaller.stats()["size"] <= 64
