"""CUDA sources of ``keras_sparse/kernels/`` compiled by CuPy (NVRTC), once per
process."""

from __future__ import annotations

import threading

import cupy as cp

from keras_sparse.kernel_sources import kernel_source

_MODULES = {}
_LOCK = threading.Lock()


def module(source="hash_table.cu"):
    """The ``cupy.RawModule`` of ``keras_sparse/kernels/<source>``."""
    with _LOCK:
        if source not in _MODULES:
            _MODULES[source] = cp.RawModule(
                code=kernel_source(source), options=("--std=c++17",)
            )
        return _MODULES[source]
