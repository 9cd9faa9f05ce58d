"""TensorFlow on a CPU: the sparse row update of SGD, Adagrad, Adam,
RowWiseAdagrad and Ftrl as one op, and the forward's gather of rows with prefetching.

Outside XLA the graph route (`keras_sparse.ops.tensorflow.row_updates`) runs a
dozen operations per table and step, two of them gathers and two scatters
that each fetch every touched row from memory. `keras_sparse/kernels/tf_rows_op.cc`
does the same update in one op: the dedup and gradient sums of
`keras_sparse/kernels/cpu_rows.c`, then one read and one write of each touched row of
the table and its slots. It is compiled on first use against the
installed TensorFlow (``$CXX``, else ``c++``; about 15 s, cached per user
like `keras_sparse.ops.native_rows`). Without a compiler, or with
``KERAS_SPARSE_NATIVE=0``, the graph route runs; `status()` says which.

The gather (`gather_rows`) copies the same rows as ``tf.gather`` and
zeros where an id is not valid, as `tensorflow_lookup.gather_valid`; it
prefetches the row 16 positions ahead, so that the cache misses of a
table larger than the caches overlap (tf.gather takes them one by one).

The update's arithmetic is the optimizer's, operation for operation, with a
correctly rounded square root; TensorFlow's own ops may round an ulp
differently (tests/test_tf_native_rows.py).
"""

import tensorflow as tf

from keras_sparse.ops import native_build
from keras_sparse.ops import optimizer_rules
from keras_sparse.ops.optimizer_rules import rule_of
from keras_sparse.ops.optimizer_rules import rule_scalars
from keras_sparse.ops.row_rounding import array_seed

SOURCE = "tf_rows_op.cc"
#: Read when a step is traced: False sends every update down the graph route.
FUSED_OPTIMIZERS = True
#: Read when a step is traced: False gathers the forward's rows by tf.gather.
PREFETCH_GATHER = True


def _flags():
    # As cpu_rows.c: no contraction into fused multiply-adds, no -march.
    # The version define keys the cache: an upgraded TensorFlow gets a
    # fresh build, not a library compiled against the old headers.
    version = f"-DKS_TF_VERSION={tf.version.VERSION}-{tf.version.GIT_VERSION}"
    return (
        "-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-w",
        version, *tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags(),
    )  # fmt: skip


def local_cpu(device):
    """Whether ``device`` is a CPU of this process (the op is loaded
    here only, and built for CPUs; `keras_sparse.cpu_allocator` advises
    only such buffers)."""
    spec = tf.DeviceSpec.from_string(device or "")
    return spec.device_type in (None, "CPU") and spec.job in (None, "localhost")


def _usable_variable(variable):
    """A local CPU variable whose handle this context may read (a mirrored
    variable has none outside a replica context)."""
    mirrored = isinstance(variable, tf.distribute.DistributedValues)
    if mirrored and tf.distribute.in_cross_replica_context():
        return False
    return local_cpu(variable.device)


_LIBRARY = native_build.source_library(
    "tf_rows_op",
    SOURCE,
    "CXX",
    "c++",
    _flags,
    lambda path: tf.load_op_library(str(path)),
)


def library():
    """The loaded op module (``tf.load_op_library``), built once; or None."""
    return _LIBRARY.get()


def status():
    """Why `library()` is what it is, in words (builds it first if needed)."""
    return _LIBRARY.status()


def fused_update(
    state, optimizer, ids, valid, grads, iterations, first, rows, constraint,
    stochastic=True, bag=1,
):  # fmt: skip
    """The update of rows ``[first, first + rows)`` of ``state``
    (``{"table": tf.Variable, slot: tf.Variable}``) from ``ids`` (int32,
    relative to ``first``), ``valid`` and ``grads``, as one op: position
    ``p`` takes gradient row ``p // bag`` (``bag=1``: per-position
    gradients; a bag's size: the bags' pooled gradients, ``[n / bag,
    dim]``). Returns its output, the number of rows updated (eagerly:
    after the update); or None, having run nothing, where the optimizer, the
    constraint, the dtypes or the build do not suit it, and the caller
    runs the graph route. An id outside ``[0, rows)`` raises, changing
    no row. bfloat16 and float16 variables take the 16-bit op, which
    rounds as `keras_sparse.ops.row_rounding` does (stochastically where
    ``stochastic``), to the bit.
    """
    found = rule_of(optimizer)
    if not FUSED_OPTIMIZERS or constraint is not None or found is None:
        return None
    rule, slot_names = found
    variables = [state["table"], *(state.get(name) for name in slot_names)]
    if set(state) != {"table", *slot_names} or any(
        v.dtype not in _STORAGE or len(v.shape) != 2 or not _usable_variable(v)
        for v in variables
    ):
        return None
    if grads.dtype != tf.float32 or library() is None:
        return None
    scalars = tf.stack(
        [tf.cast(x, tf.float32) for x in rule_scalars(optimizer, iterations, "float32")]
    )
    args = (
        [v.handle for v in variables], tf.cast(ids, tf.int32),
        tf.cast(valid, tf.bool), grads, scalars,
    )  # fmt: skip
    if all(v.dtype == tf.float32 for v in variables):
        return library().keras_sparse_row_update(
            *args, rule=rule, first=int(first), rows=int(rows), bag=int(bag)
        )
    if rule not in optimizer_rules.SIXTEEN_BIT_RULES:
        return None
    stochastic = bool(stochastic) and iterations is not None
    names = ["table", *slot_names]
    seeds = tf.stack(
        [array_seed(iterations if stochastic else 0, name) for name in names]
    )
    return library().keras_sparse_row_update16(
        *args, seeds, rule=rule, first=int(first), rows=int(rows), bag=int(bag),
        stochastic=stochastic,
    )  # fmt: skip


_STORAGE = (tf.float32, tf.bfloat16, tf.float16)


def gather_rows(table, ids, valid):
    """``table[ids]`` where ``valid``, else zero rows, as one prefetching op;
    or None where the switch, the dtype, the device or the build do not
    suit it (the caller then uses ``tf.gather``). An id outside the table
    raises ``InvalidArgumentError``, as ``tf.gather`` does on a CPU.
    """
    if not PREFETCH_GATHER or table.dtype != tf.float32 or len(table.shape) != 2:
        return None
    if not _usable_variable(table) or library() is None:
        return None
    return library().keras_sparse_gather_rows(
        table.handle, tf.cast(ids, tf.int32), tf.cast(valid, tf.bool),
        dim=int(table.shape[1]),
    )  # fmt: skip


#: Bags up to this size are summed by `gather_sums` in position order,
#: which is the order in which TensorFlow's reduce_sum adds so few rows
#: (tests/test_tf_bag_sums.py checks it against the installed TensorFlow);
#: larger bags it may add in another order.
GATHER_SUMS_MAX_BAG = 7


def gather_sums(table, ids, valid, bag):
    """``[n / bag, dim]``: each bag's valid rows of ``table`` summed (the
    bags ``bag`` consecutive positions of ``ids``), as one prefetching op,
    equal to ``tf.reduce_sum`` of `gather_rows`' bags to the bit; or None
    where the switch, the bag, the dtype, the device or the build do not
    suit it. An id outside the table raises ``InvalidArgumentError``."""
    if not PREFETCH_GATHER or not 1 <= bag <= GATHER_SUMS_MAX_BAG:
        return None
    if table.dtype != tf.float32 or len(table.shape) != 2:
        return None
    if not _usable_variable(table) or library() is None:
        return None
    return library().keras_sparse_gather_sums(
        table.handle, tf.cast(ids, tf.int32), tf.cast(valid, tf.bool),
        dim=int(table.shape[1]), bag=int(bag),
    )  # fmt: skip
