"""Compiled host work of a table with ``cache_rows`` (optional, automatic).

`keras_sparse/kernels/cpu_cache.c` is built on first use as the other CPU
helpers are (`keras_sparse.ops.native_build`) and called through ctypes on
NumPy arrays, in place: the id -> cache row mapping with its CLOCK victims
(`NativeCache.assign`, element for element what
`keras_sparse.layers.row_storage.dense_slots.DenseSlots` computes in NumPy)
and the row moves between the cache's row arrays and a dense store's
(`NativeCache.move_rows`). Without a compiler, or with
``KERAS_SPARSE_NATIVE=0``, `library()` is None, the NumPy route runs, and
`status()` (part of ``ks.compiled_cpu_helpers()``) says why.
"""

import ctypes

import numpy as np

from keras_sparse.ops import native_build

SOURCE = "cpu_cache.c"
FLAGS = ("-O2", "-fPIC", "-shared")

OUT_OF_RANGE, NO_ROOM, NO_MEMORY = -1, -2, -3
# Entries of the state array (cpu_cache.c's enum).
HAND, CALLS, HITS, MISSES, EVICTIONS, INFO, INFO2 = range(7)


class NativeCache:
    """The loaded helpers (see the module)."""

    def __init__(self, lib):
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        self._assign = lib.ks_cache_assign
        self._assign.restype = i64
        self._assign.argtypes = [ptr, i32, ptr, i64, i64, i64] + [ptr] * 11
        self._move = lib.ks_cache_move_rows
        self._move.restype = None
        self._move.argtypes = [i64, ptr, ptr, ptr, i64, ptr, ptr, ptr]

    def assign(self, ids, use, input_dim, maps, state, slots, fill, scratch):
        """`ks_cache_assign` on flat ``ids`` (int32 or int64, contiguous),
        ``use`` (bool or None: all), ``maps`` ``(slot_of_id, id_of_slot,
        referenced, used_in)``, ``state`` int64 [7]; writes ``slots`` int32
        [n] and ``fill`` bool [n] (or None), and the fills' ``scratch``
        ``(fill_pos, fill_ids, victims, evicted)`` int64 [n] each. Returns
        the fill count, or a negative error (``state[INFO]`` says more)."""
        slot_of_id, id_of_slot, referenced, used_in = maps
        return self._assign(
            ids.ctypes.data, ids.dtype.itemsize,
            None if use is None else use.ctypes.data,
            ids.shape[0], input_dim, id_of_slot.shape[0],
            slot_of_id.ctypes.data, id_of_slot.ctypes.data,
            referenced.ctypes.data, used_in.ctypes.data, state.ctypes.data,
            slots.ctypes.data, None if fill is None else fill.ctypes.data,
            *(a.ctypes.data for a in scratch),
        )  # fmt: skip

    def move_rows(self, count, victims, evicted, fill_ids, cache, store):
        """`ks_cache_move_rows` on ``count`` moves between the row arrays
        ``cache`` and ``store`` (lists of C-contiguous 2-D arrays, the same
        dtype and width pairwise)."""
        fields = len(cache)
        pointers = ctypes.c_void_p * fields
        widths = np.array([a.strides[0] for a in cache], np.int64)
        self._move(
            count, victims.ctypes.data, evicted.ctypes.data, fill_ids.ctypes.data,
            fields, pointers(*(a.ctypes.data for a in cache)),
            pointers(*(a.ctypes.data for a in store)), widths.ctypes.data,
        )  # fmt: skip


def library():
    """The `NativeCache` helpers, built or loaded once per process; or None."""
    return _LIBRARY.get()


def status():
    """Why `library()` is what it is, in words (builds it first if needed)."""
    return _LIBRARY.status()


_LIBRARY = native_build.source_library(
    "cpu_cache", SOURCE, "CC", "cc", lambda: FLAGS,
    lambda path: NativeCache(ctypes.CDLL(str(path))),
)  # fmt: skip
