"""Shared setup of the GPU layer tests: the skip conditions and a small model."""

import os

import numpy as np
import pytest


def emulated():
    """True when ``cupy`` is the CPU stand-in of ``tests/cuda_emulation``."""
    import sys

    return getattr(sys.modules.get("cupy"), "EMULATED", False)


def require_real_gpu(what):
    """Skips a test that needs real CUDA memory (e.g. a JAX GPU device)."""
    if emulated():
        pytest.skip(f"{what} needs a real GPU (CUDA is emulated here)")


def require_cuda():
    """``cupy``; skips the calling test module unless CuPy sees a GPU (or
    the CPU emulation of one)."""
    cp = pytest.importorskip("cupy", reason="CuPy is not installed; GPU tests skipped")
    try:
        n_gpus = cp.cuda.runtime.getDeviceCount()
    except Exception:  # CUDA driver missing
        n_gpus = 0
    if n_gpus == 0:
        pytest.skip("CuPy sees no CUDA device", allow_module_level=True)
    return cp


def require_cuda_and_jax():
    """Skips the calling test module unless CuPy sees a GPU (or the CPU
    emulation of one) and Keras runs JAX."""
    cp = require_cuda()
    if os.environ.get("KERAS_BACKEND", "jax") != "jax":
        pytest.skip("GPU layer tests run on the JAX backend", allow_module_level=True)
    return cp


def hashed_model(table_device, jit_compile="auto", key_dtype="int32", **kwargs):
    """``(model, layer)``: a 3-key sum-pooled DistributedHashEmbedding + Dense
    (rows initialized to 0.1 unless ``embeddings_initializer`` is given)."""
    import keras

    import keras_sparse as ks

    kwargs.setdefault("embeddings_initializer", keras.initializers.Constant(0.1))
    ids = keras.Input((3,), dtype=key_dtype)
    layer = ks.DistributedHashEmbedding(
        8,
        capacity=256,
        combiner="sum",
        optimizer="adagrad",
        table_device=table_device,
        name="hashed",
        **kwargs,
    )
    model = keras.Model(ids, keras.layers.Dense(1)(layer(ids)))
    model.compile("sgd", "mse", jit_compile=jit_compile)
    return model, layer


def keys_and_targets():
    """256 samples of 3 keys out of 400 (more than the capacity: evicts)."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 400, size=(256, 3)).astype("int32")
    return x, rng.normal(size=(256, 1)).astype("float32")


def sorted_records(records):
    order = np.argsort(records["keys"])
    return {name: values[order] for name, values in records.items()}
