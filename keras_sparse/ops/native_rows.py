"""Compiled CPU helpers for the PyTorch sparse update (optional, automatic).

`keras_sparse/kernels/cpu_rows.c` is compiled on first use by the system C compiler
(``$CC``, else ``cc``) into a per-user cache (``$KERAS_SPARSE_CACHE``, else
``$XDG_CACHE_HOME/keras_sparse`` or ``~/.cache/keras_sparse``) and loaded
with ctypes: no build step at install time and no compiler at run time
once built. Each helper does in one pass over a batch what takes several
eager torch operations. The dedup, the gradient sums and the row writes
have the same arithmetic in the same order as those operations, to the
bit; the optimizer passes (`keras_sparse.ops.native_optimizers`) may round
a square root an ulp apart from torch's.

Without a compiler, on an unsupported platform, or with
``KERAS_SPARSE_NATIVE=0``, `library()` is None and callers use torch
operations; `status()` says which and why.
"""

import ctypes

import numpy as np

from keras_sparse.ops import native_build
from keras_sparse.ops.optimizer_rules import compiled_optimizers
from keras_sparse.ops.optimizer_rules import sixteen_bit_optimizers
from keras_sparse.ops.optimizer_rules import slot_width

SOURCE = "cpu_rows.c"
# No -march=native: a cache shared by machines of different CPUs stays safe
# (the row loops carry AVX2 and AVX-512 clones, picked when loaded).
# No contraction of a * b + c into one rounding: results equal torch's.
# No errno from sqrt (its results are the same): its loops vectorize.
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
# Ids of one dedup: its hash's slot numbers must fit an int32.
MAX_IDS = 2**30


class NativeRows:
    """The loaded helpers, called on NumPy arrays (CPU tensors' memory)."""

    def __init__(self, lib):
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._distinct_sum = lib.ks_distinct_sum_strided_f32
        self._distinct_sum.restype = i64
        self._distinct_sum.argtypes = [ptr, ptr, i64, i64, ptr] + [i64] * 3 + [ptr] * 3
        self._scratch_entries = lib.ks_dedup_scratch_entries
        self._scratch_entries.restype = i64
        self._scratch_entries.argtypes = [i64]
        self._scatter_rows = lib.ks_scatter_rows_f32
        self._scatter_rows.restype = None
        self._scatter_rows.argtypes = [ptr, ptr, ptr, i64, i64]
        f32 = ctypes.c_float
        self._optimizer_rows = {
            "sgd": (lib.ks_sgd_rows_f32, 1, [f32]),
            "adagrad": (lib.ks_adagrad_rows_f32, 2, [f32, f32]),
            "adam": (lib.ks_adam_rows_f32, 3, [f32] * 4),
            "rowwise_adagrad": (lib.ks_rowwise_adagrad_rows_f32, 2, [f32, f32]),
            "ftrl": (lib.ks_ftrl_rows_f32, 3, [f32] * 5),
        }
        for function, arrays, scalars in self._optimizer_rows.values():
            function.restype = None
            function.argtypes = [ptr] * (arrays + 2) + [i64, i64] + scalars
        i32 = ctypes.c_int32
        self._widen_rows = lib.ks_widen_rows
        self._widen_rows.restype = None
        self._widen_rows.argtypes = [ptr, i32, ptr, i64, i64, ptr]
        self._narrow_rows = lib.ks_narrow_rows
        self._narrow_rows.restype = None
        self._narrow_rows.argtypes = [ptr, i32, ptr, ptr, i64, i64, i32, i32, i64]

    def distinct_sum(self, ids, valid, grads, rows, bag=1, unique=None):
        """``count``: writes the distinct valid ids (ordered by their last
        position) to ``unique[:count]`` and their gradients, summed in
        position order, to the first ``count`` rows of the returned array.

        ``ids`` ``[n]`` int64, ``valid`` ``[n]`` bool, ``grads``
        ``[n // bag, dim]`` float32 (position ``p`` reads row ``p // bag``),
        ``unique`` ``[n]`` int64 (made if None). Returns ``(count, unique,
        summed)`` with ``summed`` ``[n, dim]`` float32, rows past ``count``
        unwritten. Raises IndexError, changing nothing, when a valid id is
        outside ``[0, rows)``. Its scratch is sized by the batch (a hash of
        the ids), not by ``rows``: see `keras_sparse/kernels/cpu_rows.c`.
        """
        ids = np.ascontiguousarray(ids)
        valid = np.ascontiguousarray(valid)
        grads = _rows_view(grads)
        n, dim = ids.shape[0], grads.shape[1]
        if n > MAX_IDS:
            raise ValueError(f"sparse update: {n} ids in one call; at most {MAX_IDS}.")
        # The C code trusts these dtypes and shapes: check them here.
        kinds = (ids.dtype, valid.dtype, grads.dtype)
        if kinds != (np.int64, np.bool_, np.float32) or (ids.ndim, grads.ndim) != (
            1,
            2,
        ):
            raise TypeError(f"sparse update: ids, valid, grads of dtypes {kinds}.")
        if valid.shape != ids.shape or grads.shape[0] * bag != n:
            raise ValueError(
                f"sparse update: {n} ids, {valid.shape[0]} valid flags, "
                f"{grads.shape[0]} gradient rows for bags of {bag} do not fit."
            )
        scratch = np.empty(self._scratch_entries(n), np.int32)
        if unique is None:
            unique = np.empty(n, np.int64)
        elif (
            unique.dtype != np.int64 or unique.size < n or not unique.flags.c_contiguous
        ):
            raise ValueError(f"sparse update: `unique` must hold {n} int64 ids.")
        summed = np.empty((n, dim), np.float32)
        count = self._sum_distinct(
            ids, valid.ctypes.data, rows, grads, bag, scratch, unique, summed
        )
        return count, unique, summed

    def _sum_distinct(self, ids, valid_ptr, rows, grads, bag, scratch, unique, summed):
        """The compiled dedup: the count of distinct ids written to
        ``unique`` with their summed gradients in ``summed``; an id outside
        ``[0, rows)`` raises IndexError naming it and its position."""
        n, dim = ids.shape[0], summed.shape[1]
        count = self._distinct_sum(
            ids.ctypes.data, valid_ptr, n, rows, grads.ctypes.data,
            grads.strides[0] // 4, bag, dim, scratch.ctypes.data,
            unique.ctypes.data, summed.ctypes.data,
        )  # fmt: skip
        if count < 0:
            bad = -1 - count
            raise IndexError(
                f"sparse update: id {int(ids[bad])} at position {bad} is "
                f"outside the table's rows [0, {rows})."
            )
        return count

    def scatter_rows(self, dst, rows, src):
        """``dst[rows] = src`` for distinct ``rows`` (int64, in range),
        float32 rows; ``dst`` a C-contiguous array written in place."""
        src = np.ascontiguousarray(src)
        rows = np.ascontiguousarray(rows)
        if (
            dst.dtype != np.float32
            or src.dtype != np.float32
            or rows.dtype != np.int64
            or dst.ndim != 2
            or not dst.flags.c_contiguous
            or src.shape != (rows.shape[0], dst.shape[1])
        ):
            raise ValueError(
                f"scatter_rows: {rows.shape} rows ({rows.dtype}) of {src.shape} "
                f"({src.dtype}) into {dst.shape} ({dst.dtype}) do not fit."
            )
        self._scatter_rows(
            dst.ctypes.data, rows.ctypes.data, src.ctypes.data, rows.shape[0],
            dst.shape[1],
        )  # fmt: skip

    def optimizer_rows(self, rule, arrays, rows, grads, scalars):
        """Applies the optimizer ``rule`` ("sgd", "adagrad", "adam",
        "rowwise_adagrad" or "ftrl", see `keras_sparse/kernels/cpu_rows.c`) in place to
        ``rows`` (distinct int64, in range) of ``arrays`` (the table, then the
        rule's slots: C-contiguous float32 ``[num_rows, dim]``, or
        ``[num_rows, 1]`` for a row-wise rule's slots) from ``grads``
        (``[len(rows), dim]`` float32), with the rule's float ``scalars``."""
        function, count, names = self._optimizer_rows[rule]
        grads = np.ascontiguousarray(grads)
        rows = np.ascontiguousarray(rows)
        shape = arrays[0].shape
        slot_shape = (shape[0], slot_width(rule, shape[-1])) if shape else ()
        if (
            len(arrays) != count
            or len(scalars) != len(names)
            or any(
                a.dtype != np.float32
                or a.shape != (shape if i == 0 else slot_shape)
                or not a.flags.c_contiguous
                for i, a in enumerate(arrays)
            )
            or len(shape) != 2
            or rows.dtype != np.int64
            or grads.dtype != np.float32
            or grads.shape != (rows.shape[0], shape[1])
        ):
            raise ValueError(
                f"optimizer_rows {rule!r}: {len(arrays)} arrays of "
                f"{[(a.shape, a.dtype) for a in arrays]}, {rows.shape} rows, "
                f"gradients {grads.shape} ({grads.dtype}) do not fit."
            )
        function(
            *(a.ctypes.data for a in arrays), rows.ctypes.data, grads.ctypes.data,
            rows.shape[0], shape[1], *scalars,
        )  # fmt: skip

    def update_tables(self, rule, arrays, tables, scalars):
        """`distinct_sum`, then `optimizer_rows` with ``rule``, of each
        table of a stack, one after another, with the checks done once: the
        same calls and bits as those two per table, without their per-call
        work (a training step of 26 small tables spent as long in it as in
        the compiled code).

        ``arrays``: the rule's arrays of the whole stack, as for
        `optimizer_rows`. ``tables``: ``(ids, first, end, grads, bag)`` per
        table: ``[n]`` int64 ids relative to the table's first row
        ``first`` (all valid, checked against ``end - first`` rows), and
        ``[n // bag, dim]`` float32 gradients (position ``p`` reads row
        ``p // bag``). Raises IndexError for an id outside its table, as
        `distinct_sum` does (tables before it are updated by then).
        """
        function, count, names = self._optimizer_rows[rule]
        shape = arrays[0].shape if arrays else ()
        if (
            len(arrays) != count
            or len(scalars) != len(names)
            or len(shape) != 2
            or any(
                a.dtype != np.float32
                or a.shape
                != (shape[0], shape[1] if i == 0 else slot_width(rule, shape[1]))
                or not a.flags.c_contiguous
                for i, a in enumerate(arrays)
            )
        ):
            raise ValueError(
                f"update_tables {rule!r}: {len(arrays)} arrays of "
                f"{[(a.shape, a.dtype) for a in arrays]} do not fit."
            )
        dim = shape[1]
        checked = []
        for ids, first, end, grads, bag in tables:
            ids = np.ascontiguousarray(ids)
            grads = _rows_view(grads)
            n = ids.shape[0]
            if (
                ids.dtype != np.int64
                or ids.ndim != 1
                or grads.dtype != np.float32
                or grads.shape != (n // max(bag, 1), dim)
                or bag < 1
                or n % bag
                or not 0 <= first <= end <= shape[0]
                or n > MAX_IDS
            ):
                raise ValueError(
                    f"update_tables: ids {ids.shape} ({ids.dtype}) of rows "
                    f"[{first}, {end}), gradients {grads.shape} ({grads.dtype}) "
                    f"for bags of {bag} do not fit a [{shape[0]}, {dim}] table."
                )
            checked.append((ids, first, end, grads, bag))
        most = max((t[0].shape[0] for t in checked), default=0)
        if most == 0:
            return
        scratch = np.empty(self._scratch_entries(most), np.int32)
        unique = np.empty(most, np.int64)
        summed = np.empty((most, dim), np.float32)
        for ids, first, end, grads, bag in checked:
            n = ids.shape[0]
            if n == 0:
                continue
            found = self._sum_distinct(
                ids, None, end - first, grads, bag, scratch, unique, summed
            )
            # The table's own rows: each array from its row ``first`` on.
            function(
                *(a.ctypes.data + first * a.strides[0] for a in arrays),
                unique.ctypes.data, summed.ctypes.data, found, dim, *scalars,
            )  # fmt: skip

    def widen_rows(self, array, rows):
        """``array[rows]`` as float32 (``array`` float32, bfloat16 or
        float16, given as a C-contiguous NumPy array of its bits: float32,
        or uint16 with ``kind``; see `kind_of`)."""
        data, kind = array
        rows = self._rows_for(data, rows, "widen_rows")
        out = np.empty((rows.shape[0], data.shape[1]), np.float32)
        self._widen_rows(
            data.ctypes.data, kind, rows.ctypes.data, rows.shape[0],
            data.shape[1], out.ctypes.data,
        )  # fmt: skip
        return out

    def narrow_rows(self, array, rows, values, seed=None, first_row=0):
        """``array[rows] = values`` (float32) in place, in the array's kind:
        16-bit kinds round stochastically with the int32 ``seed``
        (`keras_sparse.ops.row_rounding`, the same bits), or to nearest
        where ``seed`` is None."""
        data, kind = array
        rows = self._rows_for(data, rows, "narrow_rows")
        values = np.ascontiguousarray(values, np.float32)
        if values.shape != (rows.shape[0], data.shape[1]):
            raise ValueError(
                f"narrow_rows: {values.shape} values for {rows.shape[0]} rows "
                f"of {data.shape}."
            )
        self._narrow_rows(
            data.ctypes.data, kind, rows.ctypes.data, values.ctypes.data,
            rows.shape[0], data.shape[1], seed is not None, int(seed or 0),
            first_row,
        )  # fmt: skip

    @staticmethod
    def _rows_for(data, rows, what):
        rows = np.ascontiguousarray(rows, np.int64)
        if (
            data.dtype not in (np.float32, np.uint16)
            or data.ndim != 2
            or not data.flags.c_contiguous
            or rows.ndim != 1
            or (rows.size and (rows.min() < 0 or rows.max() >= data.shape[0]))
        ):
            raise ValueError(
                f"{what}: rows {rows.shape} into {data.shape} ({data.dtype}) do "
                "not fit."
            )
        return rows


#: `NativeRows.widen_rows`' kinds: how the compiled code reads an array.
KINDS = {"float32": 0, "bfloat16": 1, "float16": 2}


def _rows_view(grads):
    """``grads`` as float32 rows the C code reads in place: contiguous
    rows at any row stride (a table's columns of a wider gradient, read
    without a copy), else a contiguous copy. Other dtypes pass as they
    are, for `NativeRows.distinct_sum` to refuse."""
    grads = np.asarray(grads)
    if grads.dtype != np.float32 or grads.ndim != 2:
        return grads
    row, column = grads.strides
    if column == 4 and row >= 0 and row % 4 == 0 and row >= 4 * grads.shape[1]:
        return grads
    return np.ascontiguousarray(grads)


def library():
    """The `NativeRows` helpers, built or loaded once per process; or None."""
    return _LIBRARY.get()


def status():
    """Why `library()` is what it is, in words (builds it first if needed)."""
    return _LIBRARY.status()


def compiled_cpu_helpers():
    """Whether the compiled CPU helpers of the sparse update are in use.

    On a CPU every backend runs the sparse update of a table as compiled
    code, built on first use with the system compiler and cached per
    user: PyTorch calls a small C library (the dedup, the gradient sums,
    and SGD, Adagrad, Adam, RowWiseAdagrad and Ftrl on the rows), TensorFlow
    one op of its own and JAX one XLA custom call (the same C code, built
    against the installed TensorFlow or jaxlib). Without a compiler each runs the same
    arithmetic as its own operations, about half as fast. Returns
    ``"on: <library path>; optimizers: <the compiled ones>; <what it
    serves of 16-bit tables>"`` or ``"off: <reason>"`` for the current
    backend, building first if needed. The compiled update serves float32,
    bfloat16 and float16 tables and slots (``table_dtype``,
    ``slot_dtype``): 16-bit rows are updated in float32 and written back
    rounded as the backends' own operations round them
    (`keras_sparse.ops.row_rounding`: stochastically, or to nearest with
    ``stochastic_rounding=False``), to the bit; the text names the
    optimizers it serves so (`optimizer_rules.SIXTEEN_BIT_RULES`: every
    compiled one), the others' 16-bit tables take the backend's own
    operations. The text ends with what the host side of tables with
    ``cache_rows`` runs: ``"; cache_rows map and moves: compiled (<library
    path>)"`` or ``"...: NumPy (<reason>)"`` (`keras_sparse.ops.native_cache`).

    Example:

    >>> import keras_sparse as ks
    >>> ks.compiled_cpu_helpers().split(":")[0] in ("on", "off")
    True
    """
    text = _backend_status()
    if text.startswith("on"):
        text += f"; optimizers: {', '.join(compiled_optimizers())}"
        text += f"; {sixteen_bit_route()}"
    return text + "; " + _cache_status()


def _cache_status():
    from keras_sparse.ops import native_cache

    state, _, where = native_cache.status().partition(": ")
    kind = "compiled" if state == "on" else "NumPy"
    return f"cache_rows map and moves: {kind} ({where})"


def sixteen_bit_route():
    """What `compiled_cpu_helpers` says of 16-bit tables."""
    served = sixteen_bit_optimizers()
    text = (
        "float32, bfloat16 and float16 tables and slots: 16-bit rows round "
        "stochastically (or to nearest), as the ops route rounds them, with "
        f"{', '.join(served)}"
    )
    others = [name for name in compiled_optimizers() if name not in served]
    if others:
        text += f"; the ops route updates the 16-bit tables of {', '.join(others)}"
    return text


def _backend_status():
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        from keras_sparse.ops.tensorflow import native_rows as tf_native_rows

        return tf_native_rows.status()
    if backend == "jax":
        import jax

        from keras_sparse.ops.jax import native_rows as jax_native_rows

        if jax.default_backend() != "cpu":
            return f"off: JAX runs on {jax.default_backend()}; XLA's update runs"
        return jax_native_rows.status()
    if backend != "torch":
        return f"off: no compiled helpers for the {backend} backend"
    return status()


_LIBRARY = native_build.source_library(
    "cpu_rows", SOURCE, "CC", "cc", lambda: FLAGS,
    lambda path: NativeRows(ctypes.CDLL(str(path))),
)  # fmt: skip
