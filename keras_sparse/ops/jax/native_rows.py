"""JAX on a CPU: the sparse row update of SGD, Adagrad, Adam, RowWiseAdagrad and
Ftrl as one custom call, and the forward's gather of rows with prefetching.

XLA:CPU compiles the backend-neutral update (`keras_sparse.ops.row_updates`)
into a dozen loops per table and step: the dedup, segment sums, a gather
and a scatter of the table and of each slot, each gather and scatter a
random access to every touched row. `keras_sparse/kernels/jax_rows_ffi.cc` does it in
one XLA custom call: the dedup and gradient sums of `keras_sparse/kernels/cpu_rows.c`
(a hash sized by the batch), then one read and one write of each touched
row of the table and its slots. The call's results are aliased to the
arrays it updates, so with the trainer's donated state it writes the
table's own buffer. It is compiled on first use against the installed
jaxlib's FFI headers (``$CXX``, else ``c++``; a few seconds, cached per
user like `keras_sparse.ops.native_rows`). Without a compiler, or with
``KERAS_SPARSE_NATIVE=0``, the XLA route runs; `status()` says which.

The gather (`gather_rows`, for tables larger than the caches) copies the
same rows as ``jnp.take`` and zeros where an id is not valid
(`jax_lookup.gather_valid`); it prefetches the row 16 positions ahead, so
that the cache misses of a large table overlap.

The update's arithmetic is the optimizer's, operation for operation, with
a correctly rounded square root, and the gradients of a row are summed in
position order: the XLA route sums them in another order, so the two may
differ by float32 rounding (tests/test_jax_native_rows.py).
"""

import ctypes

import jax
import jax.numpy as jnp
import numpy as np

from keras_sparse.ops import native_build
from keras_sparse.ops import optimizer_rules
from keras_sparse.ops.optimizer_rules import RULE_CODES
from keras_sparse.ops.optimizer_rules import rule_of
from keras_sparse.ops.optimizer_rules import rule_scalars
from keras_sparse.ops.row_rounding import array_seed

SOURCE = "jax_rows_ffi.cc"
#: Read when a step is traced: False sends every update down the XLA route.
FUSED_OPTIMIZERS = True
#: Read when a step is traced: whether the forward gathers rows by the
#: prefetching call. None: for tables of at least PREFETCH_MIN_BYTES, the
#: ones the caches cannot hold (26 tables x 16 floats, `switch_ab.py`: 1e6
#: rows, 64 MB each, 4% faster; 1e5 rows, 6.4 MB, 4% slower than XLA's
#: gather). True/False force it (tests, benchmarks).
PREFETCH_GATHER = None
PREFETCH_MIN_BYTES = 16 << 20
_UPDATE_TARGET = "keras_sparse_row_update"
_UPDATE_16_TARGET = "keras_sparse_row_update_16"
_STORAGE = ("float32", "bfloat16", "float16")
_GATHER_TARGET = "keras_sparse_gather_rows"


def _flags():
    # As cpu_rows.c: no contraction into fused multiply-adds, no -march.
    # The version define keys the cache: an upgraded jaxlib gets a fresh
    # build against its own headers.
    import jaxlib

    return (
        "-O3", "-std=c++17", "-ffp-contract=off", "-fno-math-errno", "-fPIC",
        "-shared", f"-I{jax.ffi.include_dir()}",
        f"-DKS_JAXLIB_VERSION={jaxlib.__version__}",
    )  # fmt: skip


def _register(path):
    lib = ctypes.CDLL(str(path))
    for target, symbol in (
        (_UPDATE_TARGET, lib.KerasSparseRowUpdate),
        (_UPDATE_16_TARGET, lib.KerasSparseRowUpdate16),
        (_GATHER_TARGET, lib.KerasSparseGatherRows),
    ):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
    return lib


_LIBRARY = native_build.source_library(
    "jax_rows_ffi", SOURCE, "CXX", "c++", _flags, _register
)


def library():
    """The loaded, registered library, built once per process; or None."""
    return _LIBRARY.get()


def status():
    """Why `library()` is what it is, in words (builds it first if needed)."""
    return _LIBRARY.status()


def _on_local_cpu(*arrays):
    """Whether every array lives on one CPU device of this process, traced
    ones included (by their abstract sharding), with no mesh in context
    and no `keras.distribution`: the custom call takes no part in XLA's
    partitioning, which would gather a sharded table whole onto every
    device for it."""
    import keras

    if keras.distribution.distribution() is not None:
        return False
    if jax.default_backend() != "cpu":
        return False
    try:
        if not jax.sharding.get_abstract_mesh().empty:
            return False
        for array in arrays:
            if isinstance(array, jax.core.Tracer):
                mesh = jax.typeof(array).sharding.mesh
                if not mesh.empty and mesh.size > 1:
                    return False
                continue
            sharding = getattr(array, "sharding", None)
            if sharding is not None and len(sharding.device_set) != 1:
                return False
    except Exception:  # a JAX without these APIs: keep XLA's route
        return False
    return True


def fused_rule(optimizer, constraint, table, slots=()):
    """``(rule, slot names)`` when the update of ``table`` (an array or a
    variable's value) and its ``slots`` by ``optimizer`` runs as the custom
    call (float32, bfloat16 or float16 arrays: 16-bit ones round as
    `keras_sparse.ops.row_rounding` does, to the bit); else None. Builds
    the library on first use."""
    found = rule_of(optimizer)
    if not FUSED_OPTIMIZERS or constraint is not None or found is None:
        return None
    dtypes = [_dtype_name(a) for a in (table, *slots)]
    if any(d not in _STORAGE for d in dtypes) or len(table.shape) != 2:
        return None
    sixteen_bit = any(d != "float32" for d in dtypes)
    if sixteen_bit and found[0] not in optimizer_rules.SIXTEEN_BIT_RULES:
        return None
    if not _on_local_cpu(table) or library() is None:
        return None
    return found


def _dtype_name(array):
    return jnp.dtype(array.dtype).name


def fused_update(
    state, optimizer, ids, valid, grads, iterations, rule, slot_names,
    stochastic=True,
):  # fmt: skip
    """``{name: array}``: ``state`` (``{"table": [rows, dim], slot: ...}``,
    float32, bfloat16 or float16) with the rows ``ids[valid]`` updated by
    ``optimizer`` from the per-position ``grads``, as one custom call whose
    results alias the arrays (16-bit ones rounded as `row_rounding` rounds,
    stochastically where ``stochastic``). ``rule``, ``slot_names``: from
    `fused_rule`. An id outside the table raises when the call runs,
    having written no row (the layers mark such ids invalid first; a step
    that donated its state has lost it either way)."""
    names = ["table", *slot_names]
    arrays = [state[name] for name in names]
    scalars = jnp.stack(
        [
            jnp.asarray(x, jnp.float32)
            for x in rule_scalars(optimizer, iterations, "float32")
        ]
    )
    inputs = (
        jnp.asarray(ids, jnp.int32),
        jnp.asarray(valid, bool),
        jnp.asarray(grads, jnp.float32),
        scalars,
        *arrays,
    )
    if any(_dtype_name(a) != "float32" for a in arrays):
        # The 16-bit call takes each array's int32 seed after the scalars.
        stochastic = stochastic and iterations is not None
        seeds = jnp.stack(
            [array_seed(iterations if stochastic else 0, name) for name in names]
        )
        updated = jax.ffi.ffi_call(
            _UPDATE_16_TARGET,
            [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays],
            input_output_aliases={5 + i: i for i in range(len(arrays))},
            vmap_method="sequential",
        )(
            *inputs[:4], seeds, *arrays, rule=np.int32(RULE_CODES[rule]),
            stochastic=np.int32(bool(stochastic)),
        )  # fmt: skip
        return dict(zip(names, updated))
    first_array = 4  # the arrays follow ids, valid, grads and scalars
    updated = jax.ffi.ffi_call(
        _UPDATE_TARGET,
        [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays],
        input_output_aliases={first_array + i: i for i in range(len(arrays))},
        vmap_method="sequential",
    )(*inputs, rule=np.int32(RULE_CODES[rule]))
    return dict(zip(names, updated))


def gather_rows(table, ids, valid):
    """``table[ids]`` where ``valid``, else zero rows, as one prefetching
    custom call; or None where the switch, the dtype, the device or the
    build do not suit it (the caller then gathers with XLA)."""
    if PREFETCH_GATHER is False or np.dtype(table.dtype) != np.float32:
        return None
    if PREFETCH_GATHER is None and table.size * 4 < PREFETCH_MIN_BYTES:
        return None
    if len(table.shape) != 2 or len(ids.shape) != 1:
        return None
    if not _on_local_cpu(table) or library() is None:
        return None
    return jax.ffi.ffi_call(
        _GATHER_TARGET,
        jax.ShapeDtypeStruct((ids.shape[0], table.shape[1]), table.dtype),
        vmap_method="sequential",
    )(table, jnp.asarray(ids, jnp.int32), jnp.asarray(valid, bool))
