"""The CPU conformance suite re-run against the CuPy table (device="gpu")."""

import pathlib
import sys

import pytest

cp = pytest.importorskip(
    "cupy", reason="CuPy is not installed; GPU hash table tests skipped"
)
try:
    _n_gpus = cp.cuda.runtime.getDeviceCount()
except Exception:  # CUDA driver missing
    _n_gpus = 0
if _n_gpus == 0:
    pytest.skip(
        "CuPy sees no CUDA device; GPU hash table tests skipped",
        allow_module_level=True,
    )

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from test_hash_table import *  # noqa: E402,F401,F403  (same test functions, GPU fixture below)


@pytest.fixture
def device():
    return "gpu"


def test_gpu_matches_cpu_rows():
    import numpy as np

    from keras_sparse.table import HashTable

    rng = np.random.default_rng(0)
    keys = rng.integers(-(2**63), 2**63 - 1, 5000, dtype=np.int64)
    cpu = HashTable(8192, device="cpu", eviction="lru")
    gpu = HashTable(8192, device="gpu", eviction="lru")
    for i in range(0, 5000, 1000):
        a = cpu.lookup_or_insert(keys[i : i + 1000]).rows
        b = gpu.lookup_or_insert(cp.asarray(keys[i : i + 1000])).rows
        assert isinstance(b, cp.ndarray)
        np.testing.assert_array_equal(a, b.get())
    np.testing.assert_array_equal(cpu.lookup(keys), gpu.lookup(keys).get())
