"""GPU table: the shared algorithm on CuPy arrays with CUDA kernels for the hot paths.

``kernels/hash_table.cu`` is compiled once per process by ``cupy.RawModule``
(NVRTC) and cached at module level.  Hashing and bucket choice are identical to
the CPU twin, so both give the same rows for the same call sequence.
Placement/eviction rounds reuse ``ArrayTable``'s vectorized code on CuPy
arrays (host syncs only where a result size must be read).
"""

from __future__ import annotations

import pathlib
import threading

import cupy as cp
import numpy as np

from .keys import to_cupy_keys  # noqa: F401  (re-exported for the front class)
from .numpy_table import ArrayTable

_KERNEL_PATH = pathlib.Path(__file__).resolve().parents[2] / "kernels" / "hash_table.cu"
_MODULE = None
_MODULE_LOCK = threading.Lock()
_BLOCK = 256


def _module():
    global _MODULE
    with _MODULE_LOCK:
        if _MODULE is None:
            _MODULE = cp.RawModule(
                code=_KERNEL_PATH.read_text(), options=("--std=c++17",)
            )
        return _MODULE


def _launch(name, n, args):
    if n:
        _module().get_function(name)(((n + _BLOCK - 1) // _BLOCK,), (_BLOCK,), args)


class CupyTable(ArrayTable):
    """``ArrayTable`` on the current CuPy device."""

    xp = cp
    device = "gpu"

    def _add_at(self, arr, idx, val):
        idx = cp.ascontiguousarray(idx, dtype=cp.int64)
        n = int(idx.shape[0])
        if arr.dtype == cp.uint32:
            val = cp.ascontiguousarray(cp.broadcast_to(val, (n,)), dtype=cp.uint32)
            _launch("ks_add_u32", n, (arr, idx, val, np.int64(n)))
        elif arr.dtype == cp.int64:
            val = cp.ascontiguousarray(cp.broadcast_to(val, (n,)), dtype=cp.int64)
            _launch("ks_add_i64", n, (arr, idx, val, np.int64(n)))
        else:
            raise TypeError(f"unsupported scatter-add dtype {arr.dtype}")

    def hash(self, k):
        k = cp.ascontiguousarray(k, dtype=cp.int64)
        n = int(k.shape[0])
        b1 = cp.empty(n, dtype=cp.int64)
        b2 = cp.empty(n, dtype=cp.int64)
        d = cp.empty(n, dtype=cp.uint8)
        _launch(
            "ks_hash",
            n,
            (
                k,
                np.int64(n),
                np.uint64(self.salt),
                np.uint64(self.num_buckets),
                b1,
                b2,
                d,
            ),
        )
        return b1, b2, d

    def probe(self, k, b1=None, b2=None, d=None):
        # The kernel rehashes in registers, cheaper than reading b1/b2/d back.
        k = cp.ascontiguousarray(k, dtype=cp.int64)
        n = int(k.shape[0])
        rows = cp.empty(n, dtype=cp.int64)
        args = (
            k,
            np.int64(n),
            np.uint64(self.salt),
            np.uint64(self.num_buckets),
            np.int32(self.bucket_size),
        )
        _launch("ks_lookup", n, args + (self.keys, self.digest, rows))
        return rows
