"""Sharing one GPU between the Keras backend and CuPy hash tables.

JAX preallocates 75% of GPU memory when it first touches the device and
TensorFlow maps nearly all of it; a CuPy hash table created afterwards then
fails to allocate. `share_gpu_memory` splits each device up front: the
framework keeps ``1 - table_fraction`` and CuPy's memory pool (where
`keras_sparse.HashTable(device="gpu")` lives) is capped at ``table_fraction``.
Call it before the framework uses the GPU (first thing in the script).
"""

import os
import warnings

import keras


def _check_fraction(table_fraction):
    if (
        isinstance(table_fraction, bool)
        or not isinstance(table_fraction, (int, float))
        or not 0.0 < float(table_fraction) < 1.0
    ):
        raise ValueError(
            "share_gpu_memory: `table_fraction` must be a number strictly "
            f"between 0 and 1. Received: table_fraction={table_fraction!r}."
        )
    return float(table_fraction)


def _share_jax(framework_fraction):
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        warnings.warn(
            "share_gpu_memory: JAX already initialized its devices, so its "
            "preallocation can no longer change; call share_gpu_memory() "
            "before the first JAX/Keras operation (or set "
            "XLA_PYTHON_CLIENT_MEM_FRACTION yourself).",
            stacklevel=3,
        )
        return "jax: already initialized, unchanged"
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{framework_fraction:.3f}"
    return f"jax: XLA_PYTHON_CLIENT_MEM_FRACTION={framework_fraction:.3f}"


def _share_tensorflow(framework_fraction):
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        try:
            # Growth rather than a fixed cap: TF then takes only what it uses.
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError as e:
            raise RuntimeError(
                "share_gpu_memory: TensorFlow already initialized its GPUs; "
                "call share_gpu_memory() before the first TensorFlow operation."
            ) from e
    return f"tensorflow: memory growth on {len(gpus)} GPU(s)"


def _share_torch(framework_fraction):
    import torch

    if not torch.cuda.is_available():
        return "torch: no CUDA device"
    for i in range(torch.cuda.device_count()):
        torch.cuda.set_per_process_memory_fraction(framework_fraction, i)
    return f"torch: per-process memory fraction {framework_fraction:.3f}"


def _cap_cupy(table_fraction):
    try:
        import cupy
    except ImportError:
        return "cupy: not installed"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        return "cupy: no CUDA device"
    for i in range(count):
        with cupy.cuda.Device(i):
            cupy.get_default_memory_pool().set_limit(fraction=table_fraction)
    return f"cupy: pool limit {table_fraction:.3f} on {count} GPU(s)"


def share_gpu_memory(table_fraction=0.25):
    """Splits every GPU between the Keras backend and CuPy hash tables.

    Args:
        table_fraction: share of each GPU's memory for CuPy (GPU hash tables),
            strictly between 0 and 1; the backend keeps the rest (JAX: its
            preallocation fraction; TensorFlow: on-demand growth; PyTorch:
            its per-process cap).

    Returns:
        A list of one line per framework saying what was set.

    Example:

    >>> import keras_sparse as ks
    >>> lines = ks.share_gpu_memory(table_fraction=0.25)
    >>> any(line.startswith("cupy") for line in lines)
    True
    """
    table_fraction = _check_fraction(table_fraction)
    framework_fraction = 1.0 - table_fraction
    share = {
        "jax": _share_jax,
        "tensorflow": _share_tensorflow,
        "torch": _share_torch,
    }.get(keras.backend.backend())
    lines = [] if share is None else [share(framework_fraction)]
    lines.append(_cap_cupy(table_fraction))
    return lines
